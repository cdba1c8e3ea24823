"""``jax-seqpar check`` (the accelerator machine's check) at tiny sizes on the CPU mesh: a
right kernel passes, a wrong one is reported as a failure, and without an accelerator the
command asks which kernel to check."""

from jax_seqpar import kernels
from jax_seqpar.tools import check
from jax_seqpar.tools.cli import main

TINY = check.Case(16, 16, "float32", seq=32, heads=2, kv_heads=1)


def test_a_right_kernel_passes_and_a_wrong_one_fails(monkeypatch):
    printed = []
    assert check.check_kernel(TINY, print_fn=printed.append)
    assert printed[-1].startswith("ok   kernel=xla 16/16 float32")

    right = kernels.attention

    def off(*args, **kwargs):  # the kernel, with its output 1 % too large
        out, lse = right(*args, **kwargs)
        return out * 1.01, lse

    monkeypatch.setattr(kernels, "attention", off)
    assert not check.check_kernel(TINY, print_fn=printed.append)
    assert printed[-1].startswith("FAIL kernel=xla")


def test_a_strategy_passes_on_the_cpu_mesh():
    printed = []
    case = check.Case(8, 8, "float32", seq=64, heads=2, kv_heads=1, kernel="xla")
    assert check.check_strategy("ring", case, print_fn=printed.append)
    assert printed == [printed[0]] and printed[0].startswith("ok   ring kernel=xla on 8 cpu")


def test_without_an_accelerator_the_kernel_must_be_named(capsys):
    assert main(["check"]) == 2
    assert "--kernel" in capsys.readouterr().err
