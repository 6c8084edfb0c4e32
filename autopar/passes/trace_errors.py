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
        if m and m.group(1).endswith("Variable"):
            # torch 2.11 names Dynamo's wrapper ("ExceptionVariable(<class 'ValueError'>)"); the graph
            # break's debug context names the exception (:func:`_observed_in_text`)
            continue
        if m:  # (torch 2.14 reports KeyError('out') so too: shown as Python shows it, KeyError: 'out')
            return m.group(1), _literal_message(m.group(2), quoted=m.group(1) == "KeyError")
        key = re.search(r'Debug representation of the key is "(.*)"\s*$', str(c), re.S)
        if key:  # torch 2.11: "Dict key lookup failed for ConstantVariable(str: 'out'). Debug representation ..."
            return name[len("Observed"):], key.group(1)
        if name != "ObservedException":
            const = re.fullmatch(r"ConstantVariable\(\w+: (.*)\)", str(c).strip(), re.S)
            return name[len("Observed"):], const.group(1) if const else str(c)
    return None


# Causes in plain words, each with its fix. The cause is the first thing a reader sees.
DATA_DEPENDENT = "data-dependent control flow"
UNSUPPORTED_OP = "unsupported op"
UNSUPPORTED_PYTHON = "Python that TorchDynamo cannot trace"
IMPORT_ERROR = "import error"
CACHE_OBJECT = "cache object"
BAD_INPUTS = "inputs that do not fit the model"
MIXED_DTYPES = "two dtypes met in one op"
FORKED = "autograd in a forked process"
_FIXES = {
    DATA_DEPENDENT: ("a Python branch, shape or number depends on a tensor's values (`if t.sum() > 0:`, "
                     "`.item()`, `.tolist()`, `int(t)`); compute it with tensor ops (torch.where, masks) or "
                     "move it out of forward, so one graph serves every batch"),
    UNSUPPORTED_OP: ("the op has no shape (fake/meta) implementation, so autopar cannot trace it without "
                     "running it; register one (torch.library.register_fake) or replace the op"),
    UNSUPPORTED_PYTHON: ("rewrite that line with torch ops, or move it out of forward (see the graph-break "
                         "explanation in the error's details)"),
    IMPORT_ERROR: ("the model's forward imports a package that is not installed; install it, or configure "
                   "the model not to need it (for Hugging Face: attn_implementation='sdpa' or 'eager')"),
    CACHE_OBJECT: ("a key/value cache object reached the trace; a training step needs none: set "
                   "config.use_cache=False and pass no past_key_values"),
    BAD_INPUTS: ("check that the example inputs and target have the number, shapes and dtypes that the "
                 "model's forward and the loss_fn expect"),
    MIXED_DTYPES: ("under precision='bf16-mixed' (the default on GPU clusters) parameters and inputs run in "
                   "bf16 while buffers and tensors made in forward keep float32, as with FSDP2's "
                   "MixedPrecisionPolicy, and this line combines the two; plan with precision='fp32', or "
                   "cast in forward (`.to(x.dtype)`)"),
    FORKED: ("this process was forked (multiprocessing's default start on Linux) from one that had run "
             "autograd, and torch (its CUDA builds) cannot run it in such a child; plan in the parent, or "
             "start the process with multiprocessing's 'spawn' or 'forkserver' method"),
}


def _cause(text: str, root: BaseException | None, chain: list[BaseException], source: str) -> str:
    """Which of the causes above explains ``text`` (the whole exception chain, as text)."""
    if isinstance(root, ImportError):
        return IMPORT_ERROR
    if "autograd's threading in combination with fork" in text:  # (a trace runs a backward)
        return FORKED
    if "Cache" in source or re.search(r"\w*Cache\b.*(not supported|unsupported|cannot)", text):
        return CACHE_OBJECT
    if any(k in text for k in ("Data-dependent", "data-dependent", "_local_scalar_dense", "DataDependent",
                               "data dependent")):
        return DATA_DEPENDENT
    if any(k in text for k in ("no fake impl", "no meta impl", "NotImplementedError", "does not have a meta",
                               "fake tensor mode", "Could not run")):
        return UNSUPPORTED_OP
    if re.search(r"expected scalar type [\w.]+ but found [\w.]+|same dtype", text) and \
            re.search(r"bfloat16|BFloat16|float16|Half", text):
        # (before BAD_INPUTS: the inputs may be fine, the precision policy is not; a mismatch with
        # no half-precision side, float64 against float32 say, is not the policy's and stays BAD_INPUTS)
        return MIXED_DTYPES
    if isinstance(root, TypeError) or any(type(c).__name__ == "TorchRuntimeError" for c in chain):
        return BAD_INPUTS
    return UNSUPPORTED_PYTHON


def trace_error(e: BaseException, model_name: str) -> Exception:
    """The one-line error to raise for ``e``, an exception from capturing ``model_name``.

    It reads "could not trace M at FILE:LINE (op X): CAUSE: what torch said. Try: FIX", where
    FILE:LINE is the innermost frame outside torch and autopar (the user's or the model
    library's line) and CAUSE one of the plain-words causes above; an exception the traced
    code raised itself is reported as the user's, and an import error as an import error.
    The whole chain is kept in ``.details``.
    """
    chain, cur = [], e
    while cur is not None and len(chain) < 20:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    for c in chain:
        if isinstance(c, LossError):
            return c
    text = "\n".join(str(c) for c in chain)
    # torch 2.14's Dynamo re-raises an op that failed on fake tensors inside the traced frame, so
    # the chain holds an Observed<Name> as if the user's code had raised it; it is the op's failure
    fake_op = any(type(c).__name__ == "FakeTensorObservedException" for c in chain)
    observed = None if fake_op else _observed(chain) or _observed_in_text(text)
    if observed and observed[0] == LossError.__name__:
        return LossError(observed[1])
    first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
    found = re.findall(r'File "([^"]+)", line (\d+)', text)
    for c in chain:  # Dynamo keeps the traced code's stack on some exceptions rather than in their text
        found += [(fs.filename, str(fs.lineno)) for fs in getattr(c, "real_stack", None) or ()]
    frames = [(f, ln) for f, ln in found if "/torch/" not in f and "/autopar/passes/" not in f]
    where = f"{frames[-1][0]}:{frames[-1][1]}" if frames else ""
    if observed and observed[0] in ("ImportError", "ModuleNotFoundError"):
        err = TraceError(f"could not trace {model_name}{' at ' + where if where else ''}: {IMPORT_ERROR}: "
                         f"{observed[0]}: {observed[1][:300]}. Try: {_FIXES[IMPORT_ERROR]}")
        err.details = text
        return err
    if observed and frames:  # the user's code raised, as it would have outside the trace: say so, and where
        err = TraceError(f"{where}: {observed[0]}: {observed[1][:300]} (raised by "
                         f"{model_name}'s forward or the loss_fn while autopar traced it, not by autopar)")
        err.details = text
        return err
    # Dynamo's headline ("RuntimeError when making fake tensor call") hides the cause: the plain
    # exception at the root of the chain ("a and b must have same reduction dim, [8, 5] X [4, 4]").
    root = next((c for c in reversed(chain) if type(c).__module__ == "builtins" and str(c).strip()), None)
    if root is None:  # torch 2.14: inputs that do not bind to forward are Dynamo's own TypeError subclass
        root = next((c for c in reversed(chain) if isinstance(c, TypeError) and str(c).strip()
                     and not type(c).__name__.startswith("Observed")), None)
    if root is not None:
        shown = next(k.__name__ for k in type(root).__mro__ if k.__module__ == "builtins")
        first = f"{shown}: {str(root).strip().splitlines()[0]}"
    source = linecache.getline(frames[-1][0], int(frames[-1][1])) if frames else ""
    op = re.search(r"(aten\.\w+(?:\.\w+)?)", text) or re.search(r"<CustomOpDef\(([\w:.]+)\)>", text)
    what = f" (op {op.group(1)})" if op else ""
    cause = _cause(text, root, chain, source)
    fix = _FIXES[cause]
    if frames and "/transformers/" in frames[-1][0] and "expert" in source and \
            "use_experts_implementation" in "".join(linecache.getlines(frames[-1][0])):
        # Hugging Face's "eager" experts loop in Python over the experts that received tokens; the
        # file offers other implementations (JetMoE's own routing, with .tolist(), offers none)
        fix = ("for this Hugging Face mixture-of-experts model, load it with "
               "experts_implementation='grouped_mm' (the default), which runs all experts as one grouped matmul")
    if cause == DATA_DEPENDENT and "layerdrop" in source.lower():
        # LayerDrop (fairseq, Hugging Face's BART/M2M100/NLLB/SeamlessM4T/...): whole layers skipped at random
        fix = ("this is LayerDrop: in training the model skips whole layers at random, so each step runs "
               "another graph and no single plan fits; turn it off in the config (Hugging Face: "
               "encoder_layerdrop=0.0, decoder_layerdrop=0.0 or layerdrop=0.0)")
    err = TraceError(f"could not trace {model_name}{' at ' + where if where else ''}{what}: {cause}: "
                     f"{first[:200].rstrip('.')}. Try: {fix}")
    err.details = text
    return err


def _observed_in_text(text: str) -> tuple[str, str] | None:
    """An exception the traced code raised, as Dynamo's graph-break text names it
    ("Developer debug context: raised exception ImportError('...')")."""
    for m in re.finditer(r"raised exception (\w+)\((.*?)\)\s*$", text, re.M):
        if not m.group(1).endswith("Variable"):  # (Dynamo's wrapper, not the exception: torch 2.11)
            return m.group(1), _literal_message(m.group(2), quoted=m.group(1) == "KeyError")
    return None


def _literal_message(args_repr: str, *, quoted: bool = False) -> str:
    """The first argument of an exception's repr ("'msg'" -> "msg"; ``quoted``: as ``str(KeyError)``
    shows it, "'msg'"), or the text itself."""
    # torch 2.11 writes the arguments as Dynamo's constants, in a list or a tuple:
    # ValueError([ConstantVariable(str: 'msg')])
    args_repr = re.sub(r"""ConstantVariable\(\w+: ('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")\)""", r"\1", args_repr)
    try:
        args = ast.literal_eval(f"({args_repr},)")
    except (ValueError, SyntaxError):
        return args_repr
    while len(args) == 1 and isinstance(args[0], (list, tuple)):
        args = args[0]
    if not args:
        return ""
    return repr(args[0]) if quoted else str(args[0])
