"""bf16 on a CPU: which instruction set the CPU has for it, and the warning a run gets where torch must emulate it."""
import warnings
from pathlib import Path

import pytest

from crl.config import load_config
from crl.training import accelerator as acc

ROOT = Path(__file__).resolve().parents[1]
FLAGS = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx2 fma {extra}\n\n"


@pytest.mark.parametrize("extra, found", [("", None), ("avx512f avx512_bf16", "avx512_bf16"),
                                          ("avx512_bf16 amx_bf16 amx_tile", "amx_bf16")])
def test_native_bf16_reads_the_cpus_flags(tmp_path, extra, found):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(FLAGS.format(extra=extra))
    assert acc.native_bf16(cpuinfo) == found


def test_native_bf16_is_none_without_a_flags_line_or_a_file(tmp_path):
    (tmp_path / "cpuinfo").write_text("processor\t: 0\n")
    assert acc.native_bf16(tmp_path / "cpuinfo") is None
    assert acc.native_bf16(tmp_path / "absent") is None


@pytest.mark.parametrize("precision, native, warns", [("bf16", None, True), ("bf16", "avx512_bf16", False),
                                                      ("fp32", None, False), ("auto", None, False)])
def test_bf16_on_a_cpu_that_emulates_it_warns_and_names_the_fix(monkeypatch, precision, native, warns):
    from accelerate.state import AcceleratorState

    monkeypatch.setattr(acc, "native_bf16", lambda: native)
    monkeypatch.setattr(acc.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(acc.platform, "machine", lambda: "x86_64")  # the flags are x86's
    cfg = load_config(ROOT / "configs" / "default.yaml", [f"train.precision={precision}"])
    AcceleratorState._reset_state()  # a process-wide singleton: an earlier accelerator fixed its precision
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            accelerator, _ = acc.make_accelerator(cfg)
        mixed = accelerator.mixed_precision
    finally:
        AcceleratorState._reset_state()
    ours = [w for w in caught if "train.precision=bf16" in str(w.message)]
    assert len(ours) == int(warns)
    if warns:
        assert "train.precision=fp32" in str(ours[0].message)
    assert mixed == ("bf16" if precision == "bf16" else "no")
