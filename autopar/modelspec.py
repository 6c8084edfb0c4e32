"""Load a model from a model spec `FILE.py:FN`, as the CLI's first argument names it.

    load_model_spec("examples/gpt.py:build", {"size": "tiny"})
    -> (model, example_inputs, loss_fn, example_target)

FILE is a path relative to the current directory; it is loaded as a fresh module
(a plain script, not part of a package). FN is called with the `--arg key=value`
pairs as string keyword arguments and returns `(model, example_inputs)`,
`(model, example_inputs, loss_fn)` or `(model, example_inputs, loss_fn,
example_target)`; the missing tail is filled with None.

Errors in the user's file or function (a syntax error, an exception, a
`sys.exit()`) are the user's, not autopar's: they come back as one
`UserCodeError` that names the file, line and function where they were raised.
"""
import hashlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Mapping
from typing import Any

import torch.nn as nn

from autopar.errors import UserCodeError

__all__ = ["load_model_spec"]

_FORM = "expected the form FILE.py:FN, e.g. examples/gpt.py:build"


def _split_spec(spec: str) -> tuple[str, str]:
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"model spec {spec!r} has no ':'; {_FORM}")
    path, _, fn_name = spec.rpartition(":")
    if not path or not fn_name:
        raise ValueError(f"model spec {spec!r} is missing the file or the function name; {_FORM}")
    if not fn_name.isidentifier():
        raise ValueError(f"model spec {spec!r}: {fn_name!r} is not a function name; {_FORM}")
    return path, fn_name


def _load_module(spec: str, path: str):
    if not os.path.isfile(path):
        raise ValueError(f"model spec {spec!r}: no file {path!r} (relative to {os.getcwd()}); {_FORM}")
    abs_path = os.path.abspath(path)
    # A unique name per file, so two specs never share (or clobber) a module.
    stem = os.path.splitext(os.path.basename(abs_path))[0]
    digest = hashlib.sha1(abs_path.encode()).hexdigest()[:12]
    module_name = f"_autopar_modelspec_{''.join(c if c.isalnum() else '_' for c in stem)}_{digest}"
    import_spec = importlib.util.spec_from_file_location(module_name, abs_path)
    if import_spec is None or import_spec.loader is None:
        raise ValueError(f"model spec {spec!r}: {path!r} cannot be loaded as a Python file; {_FORM}")
    module = importlib.util.module_from_spec(import_spec)
    # Registered before exec so dataclasses and pickling can find the module.
    sys.modules[module_name] = module
    try:
        import_spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:
        sys.modules.pop(module_name, None)
        raise _user_error(e, spec, path, "loading the file") from e
    except BaseException:  # Ctrl-C is the user's wish, not an error in their file
        sys.modules.pop(module_name, None)
        raise
    return module


def _user_error(e: BaseException, spec: str, path: str, doing: str) -> UserCodeError:
    """One line for an exception raised by the user's file: where, what, whose."""
    abs_path = os.path.abspath(path)
    where, line = path, 0
    if isinstance(e, SyntaxError) and e.filename and os.path.abspath(e.filename) == abs_path:
        line = e.lineno or 0
        where = f"{path}:{line}"
    else:
        # The innermost frame in the user's file: their line, not the library call it made.
        tb, frame = e.__traceback__, None
        while tb is not None:
            if os.path.abspath(tb.tb_frame.f_code.co_filename) == abs_path:
                frame = tb
            tb = tb.tb_next
        if frame is not None:
            line = frame.tb_lineno
            where = f"{path}:{line} in {frame.tb_frame.f_code.co_name}"
    hint = ""
    if isinstance(e, SystemExit):
        what, hint = f"called sys.exit({e.code!r})", "; a model spec function must return (model, example_inputs, ...)"
    else:
        text = e.msg if isinstance(e, SyntaxError) else str(e)
        what = f"{type(e).__name__}: {text}" if text else type(e).__name__
        if isinstance(e, ImportError):  # a package the file imports is missing: say so in plain words
            missing = f" {e.name!r}" if getattr(e, "name", None) else ""
            hint = (f"; this is an import error: install the missing package{missing} in this Python "
                    f"environment, or fix the import")
    return UserCodeError(f"{where}: {what} (raised by your model spec while {doing}, not by autopar){hint}",
                         original=e, path=path, line=line)


def load_model_spec(spec: str, args: Mapping[str, Any] | None = None) -> tuple[nn.Module, Any, Any, Any]:
    """Call the function a model spec names and return a 4-tuple.

    Contract: `spec` is "FILE.py:FN" with FILE relative to the current directory;
    `args` are passed to FN as keyword arguments unchanged (the CLI gives
    strings). Returns (model, example_inputs, loss_fn, example_target), the
    last two None when FN does not return them. Raises ValueError naming the
    spec for a spec without ':', a missing file or function, or a result that
    is not a 2-, 3- or 4-tuple whose first item is an nn.Module; UserCodeError
    (its __cause__ the original) for anything the file or FN raises, including
    SyntaxError and SystemExit. KeyboardInterrupt propagates.
    """
    path, fn_name = _split_spec(spec)
    module = _load_module(spec, path)
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        available = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_") and getattr(v, "__module__", None) == module.__name__)
        raise ValueError(
            f"model spec {spec!r}: {path!r} has no function {fn_name!r} (it has: {', '.join(available) or 'none'}); {_FORM}"
        )
    args = dict(args or {})
    try:  # a wrong --arg is a usage mistake, not an error in the user's code
        inspect.signature(fn).bind(**args)
    except TypeError as e:
        given = ", ".join(f"{k}={v!r}" for k, v in args.items()) or "no arguments"
        raise ValueError(f"model spec {spec!r}: {fn_name}{inspect.signature(fn)} cannot take {given} ({e}); "
                         f"check the --arg names") from None
    except ValueError:  # no signature to check (a builtin): let the call say
        pass
    try:
        result = fn(**args)
    except (Exception, SystemExit) as e:
        called = f"{fn_name}({', '.join(f'{k}={v!r}' for k, v in args.items())})"
        raise _user_error(e, spec, path, f"calling {called}") from e
    if not isinstance(result, tuple) or not 2 <= len(result) <= 4:
        got = f"a {len(result)}-tuple" if isinstance(result, tuple) else type(result).__name__
        raise ValueError(
            f"model spec {spec!r}: {fn_name}() returned {got}; expected (model, example_inputs[, loss_fn[, example_target]]); {_FORM}"
        )
    if not isinstance(result[0], nn.Module):
        raise ValueError(f"model spec {spec!r}: {fn_name}() returned {type(result[0]).__name__} as the model, expected an nn.Module; {_FORM}")
    model, example_inputs, loss_fn, example_target = result + (None,) * (4 - len(result))
    return model, example_inputs, loss_fn, example_target
