"""Turn what torch raises while capturing a model into one line that says what to do.

Dynamo wraps everything: an exception the user's own code raised while being
traced reaches us as an "Observed<Name>" exception, a data-dependent branch as a
guard failure deep in a chain. :func:`trace_error` digs out the user's exception
or the op, names the innermost source line outside torch, and adds a hint.
"""

from __future__ import annotations

import ast
import linecache
import re

from autopar.errors import LossError, TraceError

__all__ = ["trace_error"]


def _observed(chain: list[BaseException]) -> tuple[str, str] | None:
    """(exception name, message) of an exception raised by the traced code itself, if any.

    Dynamo reports it as ``ObservedException`` "raised exception Name('msg')", or as
    ``Observed<Name>`` (ObservedKeyError, ...) whose text is the argument's variable,
    "ConstantVariable(str: 'foo')".
    """
    for c in chain:
        name = type(c).__name__
        if not name.startswith("Observed"):
            continue
        m = re.match(r"raised exception (\w+)\((.*)\)\s*$", str(c), re.S)
        if m:
            return m.group(1), _literal_message(m.group(2))
        if name != "ObservedException":
            const = re.fullmatch(r"ConstantVariable\(\w+: (.*)\)", str(c).strip(), re.S)
            return name[len("Observed"):], const.group(1) if const else str(c)
    return None


def trace_error(e: BaseException, model_name: str) -> Exception:
    """The one-line error to raise for ``e``, an exception from capturing ``model_name``."""
    chain, cur = [], e
    while cur is not None and len(chain) < 20:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    for c in chain:
        if isinstance(c, LossError):
            return c
    observed = _observed(chain)
    if observed and observed[0] == LossError.__name__:
        return LossError(observed[1])
    text = "\n".join(str(c) for c in chain)
    first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
    frames = [(f, ln) for f, ln in re.findall(r'File "([^"]+)", line (\d+)', text)
              if "/torch/" not in f and "/autopar/passes/" not in f]
    if observed and frames:  # the user's code raised, as it would have outside the trace: say so, and where
        err = TraceError(f"{frames[-1][0]}:{frames[-1][1]}: {observed[0]}: {observed[1][:300]} (raised by "
                         f"{model_name}'s forward or the loss_fn while autopar traced it, not by autopar)")
        err.details = text
        return err
    # Dynamo's headline ("RuntimeError when making fake tensor call") hides the cause: the plain
    # exception at the root of the chain ("a and b must have same reduction dim, [8, 5] X [4, 4]").
    root = next((c for c in reversed(chain) if type(c).__module__ == "builtins" and str(c).strip()), None)
    if root is not None:
        first = f"{type(root).__name__}: {str(root).strip().splitlines()[0]}"
    mismatch = isinstance(root, TypeError) or any(type(c).__name__ == "TorchRuntimeError" for c in chain)
    where = f" at {frames[-1][0]}:{frames[-1][1]}" if frames else ""
    op = re.search(r"(aten\.\w+(?:\.\w+)?)", text)
    what = f" (op {op.group(1)})" if op else ""
    hint = ""
    source = linecache.getline(frames[-1][0], int(frames[-1][1])) if frames else ""
    if frames and "/transformers/" in frames[-1][0] and "expert" in source:
        # Hugging Face's "eager" experts loop in Python over the experts that received tokens
        hint = ("; for this Hugging Face mixture-of-experts model, load it with "
                "experts_implementation='grouped_mm' (the default), which runs all experts as one grouped matmul")
    if mismatch and not hint:  # an op refused its arguments: most often inputs that do not fit the model
        advice = ("check that the example inputs and target have the number, shapes and dtypes that the "
                  "model's forward and the loss_fn expect")
    else:
        advice = ("make the model's forward free of data-dependent Python control flow, return plain tensors "
                  f"(use_cache=False for Hugging Face models), or build it on 'cpu' with small shapes{hint}")
    err = TraceError(f"could not trace {model_name}{where}{what}: {first[:200].rstrip('.')}. Try: {advice}")
    err.details = text
    return err


def _literal_message(args_repr: str) -> str:
    """The first argument of an exception's repr ("'msg'" -> "msg"), or the text itself."""
    try:
        args = ast.literal_eval(f"({args_repr},)")
    except (ValueError, SyntaxError):
        return args_repr
    return str(args[0]) if args else ""
