"""Model spec functions, each with one mistake, for tests/test_bad_inputs.py.

The test copies this file into a scratch directory as ``specs.py`` and runs
``autopar plan specs.py:FN``; a line marked ``# LINE name`` is where the test
expects the error to be reported.
"""
import sys
import time
import torch
import torch.nn as nn
import torch.nn.functional as F


def x():
    return torch.randn(8, 4)


def ok():
    return nn.Linear(4, 4), (x(),), F.mse_loss, x()


def needs_size(size):
    return ok()


def raises_runtime():
    raise RuntimeError("my model broke")  # LINE raises_runtime


def raises_key():
    table = {}
    return table["foo"]  # LINE raises_key


def helper_raises():
    return nn.Linear(4, 4), (torch.randn(8, -1),)


def exits_0():
    sys.exit(0)


def exits_message():
    sys.exit("giving up")


def not_a_tuple():
    return nn.Linear(4, 4)


def five():
    return nn.Linear(4, 4), (x(),), None, None, None


def not_a_model():
    return "model", (x(),)


def int_loss():
    return nn.Linear(4, 4), (x(),), lambda out, t: 3, x()


def unreduced_loss():
    return nn.Linear(4, 4), (x(),), lambda out, t: F.mse_loss(out, t, reduction="none"), x()


def long_loss():
    return nn.Linear(4, 4), (x(),), lambda out, t: (out > 0).sum(), x()


def no_loss():
    return nn.Linear(4, 3), (x(),)


def target_batch():
    return nn.Linear(4, 4), (x(),), F.mse_loss, torch.randn(6, 4)


def frozen():
    model = nn.Linear(4, 4)
    model.requires_grad_(False)
    return model, (x(),), F.mse_loss, x()


def no_params():
    return nn.ReLU(), (torch.randn(8, 4, requires_grad=True),), lambda out, t: out.sum()


def empty_batch():
    return nn.Linear(4, 4), (torch.randn(0, 4),), F.mse_loss, torch.randn(0, 4)


def string_inputs():
    return nn.Linear(4, 4), "not a tensor"


def sleeps(marker):
    open(marker, "w").close()
    # Until interrupted: a bounded sleep raced the test's SIGINT on a loaded machine (the test
    # got no CPU for 120 s, the spec returned None and the CLI exited 2); the test's own
    # communicate(timeout=...) and kill bound this.
    while True:
        time.sleep(1)


class RaisesInForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scales = {}

    def forward(self, x):
        return self.lin(x) * self.scales["out"]  # LINE forward_raises


def forward_raises():
    return RaisesInForward(), (x(),), F.mse_loss, x()


def loss_raises():
    def loss(out, target):
        raise ValueError("loss broke")  # LINE loss_raises

    return nn.Linear(4, 4), (x(),), loss, x()


def wrong_width():
    return nn.Linear(4, 4), (torch.randn(8, 5),), F.mse_loss, x()


def too_many_inputs():
    return nn.Linear(4, 4), (x(), x()), F.mse_loss, x()


NOT_CALLABLE = 3
