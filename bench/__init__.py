"""Benchmarks and measurements of the modules, kept out of them: they import the library, never the
reverse.

    python -m bench.sampler      hf and kv sampler speed; --verifier-prompts: the verifier's prompts
    python -m bench.grpo         one GRPO update per configuration (time, peak memory)
    python -m bench.verifier     --measure: the offline verifiers' recall; --demo; --steps RUN
    python -m bench.sandbox      the warm pool against `python -c`; --selftest: the protections here
    python -m bench.answers      is_equiv against bare math-verify and string matching
    python -m bench.identity     a run's fingerprint: weights, metrics and rollouts (a change alike?)
    python -m bench.training_study  select, arm ttrl|t3rl, report: training where the votes disagree
"""
