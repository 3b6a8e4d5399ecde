"""The machinery beside the reader's path: what a run needs that is not the method (README's file
table lists its modules). `import machinery` loads none of them; machinery.runs, say, imports
machinery/runs.py on first use, so the reader's code names each call into the machinery."""
import importlib


def __getattr__(name: str):
    if name.startswith("_"):
        raise AttributeError(name)
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as err:
        if err.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no module {name!r}") from None
