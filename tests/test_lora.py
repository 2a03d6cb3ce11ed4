"""LoRA (``model.lora``, crl/modules/lora.py): what is trained, what a checkpoint holds, and the runs users launch.

In-process: the merged weights against peft's own ``merge_and_unload`` (an independent computation), the resume's
merged-weights check (rounding accepted, a moved base weight named), the strict adapter loader, the frozen summariser
with the adapter disabled against the base model, only adapter tensors in the actor's optimizer, and the config
refusals. Through ``scripts/train.py`` (subprocesses): one process interrupted and resumed equals an uninterrupted
run, audit PASS, and the merged ``policy/`` loads with ``from_pretrained`` (no peft) and samples the adapter model's
tokens; a resume onto a changed preset stops naming ``model.preset``; ZeRO-2 on two CPU ranks, resumed, audit PASS.
"""
import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from crl.config import ConfigValidationError, load_config
from crl.modules.networks import build_causal_lm

ROOT = Path(__file__).resolve().parents[1]
LORA = ["model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=8"]


def tiny_lm(seed=0):
    return build_causal_lm("llama-tiny", vocab_size=64, max_positions=64, eos_token_id=1, seed=seed)


def lora_settings(**kw):
    return load_config(ROOT / "configs" / "default.yaml", LORA + [f"model.lora.{k}={v}" for k, v in kw.items()]).model.lora


def perturbed_lora_lm(seed=0):
    """A LoRA model whose adapters are not zero (B starts at 0: the delta would be nothing to check)."""
    from crl.modules.lora import apply_lora

    lm = apply_lora(tiny_lm(seed), lora_settings())
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return lm


def test_merged_state_dict_equals_peft_merge_and_a_plain_model_loads_it_strictly():
    from crl.modules.lora import merged_state_dict

    lm = perturbed_lora_lm()
    before = {k: v.clone() for k, v in lm.state_dict().items()}
    merged = merged_state_dict(lm)
    assert all(torch.equal(before[k], v) for k, v in lm.state_dict().items()), "merged_state_dict modified the model"
    reference = copy.deepcopy(lm).merge_and_unload().state_dict()  # peft's own merge, on a copy
    assert merged.keys() == reference.keys()
    for k in reference:
        torch.testing.assert_close(merged[k], reference[k], rtol=0, atol=1e-6)
    base = lm.get_base_model().state_dict()
    adapted = [k for k in merged if f"{k[:-7]}.base_layer.weight" in base]
    assert len(adapted) == 7 * lm.config.num_hidden_layers
    assert all(not torch.equal(merged[k], base[f"{k[:-7]}.base_layer.weight"]) for k in adapted), "a zero delta: nothing was checked"
    plain = tiny_lm(seed=5)
    plain.load_state_dict(merged, strict=True)
    x = torch.randint(2, 64, (2, 10))
    torch.testing.assert_close(plain(input_ids=x).logits, lm(input_ids=x).logits, rtol=1e-5, atol=1e-5)


def test_merged_differences_accept_the_same_base_within_rounding_and_name_any_other(tmp_path):
    """crl.modules.lora.merged_differences, the LoRA resume's check: the checkpoint's merged weights against the merge of
    its adapter onto the base weights at hand. The same base: none, also against a merge computed in another order
    (float64, rounded once: within the rounding bound, though not bit-equal); a base weight moved by 1e-4 in an
    adapted layer, or by one ulp in a layer the merge leaves as it is, is named."""
    from crl.modules.lora import merged_differences, merged_state_dict
    from crl.training.checkpoints import save_weights

    lm = perturbed_lora_lm()
    save_weights(merged_state_dict(lm), tmp_path / "same.safetensors")
    assert merged_differences(lm, tmp_path / "same.safetensors") == []

    base = lm.get_base_model()
    other_order = dict(merged_state_dict(lm))
    for name, module in base.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            w, a, b = (t.detach().double()
                       for t in (module.get_base_layer().weight, module.lora_A["default"].weight, module.lora_B["default"].weight))
            other_order[f"{name}.weight"] = (w + module.scaling["default"] * (b @ a)).float()
    assert any(not torch.equal(other_order[k], v) for k, v in merged_state_dict(lm).items()), "the same bits: nothing was checked"
    save_weights(other_order, tmp_path / "other_order.safetensors")
    assert merged_differences(lm, tmp_path / "other_order.safetensors") == []

    with torch.no_grad():
        base.model.layers[1].self_attn.q_proj.base_layer.weight[0, 0] += 1e-4
        base.model.embed_tokens.weight[3, 2] = torch.nextafter(base.model.embed_tokens.weight[3, 2], torch.tensor(1.0))
    lines = merged_differences(lm, tmp_path / "same.safetensors")
    assert len(lines) == 2, lines
    assert lines[0].startswith("model.embed_tokens.weight: differs by up to") and "must be bit-equal" in lines[0]
    assert lines[1].startswith("model.layers.1.self_attn.q_proj.weight: differs by up to 0.0001") and "rounding bound" in lines[1]


def _sample(model, seed=3):
    from crl.modules.generation import TransformersBackend
    from crl.sampling import SamplingSpec

    gens = TransformersBackend(model, seed=seed).generate([[5, 6, 7], [9, 10]], [12, 12], SamplingSpec(1.0, 1.0, stop_token_ids=(1,)))
    return [g.token_ids for g in gens], [x for g in gens for x in g.log_probs]


def parameters_computed_with(module, **inputs) -> set[int]:
    """The storage (``data_ptr``) of every parameter a call of ``module`` computes with: each torch function's
    ``nn.Parameter`` arguments (a linear layer's weight, an embedding's table, a norm's scale)."""
    from torch.overrides import TorchFunctionMode

    used = set()

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            used.update(a.data_ptr() for a in (*args, *kwargs.values()) if isinstance(a, torch.nn.Parameter))
            return func(*args, **kwargs)

    with Record(), torch.no_grad():
        module(**inputs)
    return used


def test_the_frozen_summariser_keeps_the_adapter_of_rl_start_and_shares_the_base_weights():
    from crl.modules.lora import FrozenAdapterLM, apply_lora

    # before any training (B = 0) the frozen summariser is the pretrained model
    fresh = apply_lora(tiny_lm(), lora_settings())
    tokens, logp = _sample(FrozenAdapterLM(fresh))
    base_tokens, base_logp = _sample(tiny_lm())
    assert tokens == base_tokens and logp == pytest.approx(base_logp, abs=1e-5)

    # after a warm start it is the warm-started policy, and stays so while the policy's adapter trains on
    lm = perturbed_lora_lm()
    start_tokens, start_logp = _sample(lm)
    frozen = FrozenAdapterLM(lm)
    assert list(frozen.parameters()) == []  # not a submodule: the policy saves, moves and trains the base weights
    # it computes with the policy's own base tensors (the same storage, not a copy) and the frozen adapter, never the
    # policy's adapter
    used = parameters_computed_with(frozen, input_ids=torch.randint(2, 64, (2, 10)))
    params = dict(lm.named_parameters())
    base, frozen_adapter, policy_adapter = ({p.data_ptr() for n, p in params.items() if keep(n)} for keep in (
        lambda n: "lora_" not in n, lambda n: ".frozen." in n, lambda n: ".default." in n))
    assert used == base | frozen_adapter and not used & policy_adapter, "the frozen summariser computes with other tensors"
    assert all(not p.requires_grad for n, p in lm.named_parameters() if ".frozen." in n)
    assert all(p.requires_grad for n, p in lm.named_parameters() if ".default." in n)
    with torch.no_grad():  # the policy moves on
        for n, p in lm.named_parameters():
            if "lora_B.default" in n:
                p.add_(0.1)
    tokens, logp = _sample(frozen)
    assert tokens == start_tokens and logp == pytest.approx(start_logp, abs=1e-5)
    moved_tokens, moved_logp = _sample(lm)
    assert moved_tokens != start_tokens or moved_logp != pytest.approx(start_logp, abs=1e-3), "the policy did not move: nothing was checked"
    lm.train()  # a call restores the policy's mode
    _sample(frozen)
    assert lm.training


def test_load_adapter_is_strict_about_names_and_shapes(tmp_path):
    """crl.modules.lora.load_adapter_ restores a saved adapter exactly, and refuses, naming the tensors, a file with the
    same number of tensors under other names (peft's loader would load nothing and say nothing) or of another rank."""
    from safetensors.torch import load_file, save_file

    from crl.modules.lora import apply_lora, load_adapter_, save_adapter

    saved = perturbed_lora_lm()
    save_adapter(saved, tmp_path / "ok")
    fresh = apply_lora(tiny_lm(), lora_settings())
    load_adapter_(fresh, tmp_path / "ok")
    want = {n: p for n, p in saved.named_parameters() if "lora_" in n}
    assert want and all(torch.equal(p, want[n]) for n, p in fresh.named_parameters() if "lora_" in n)

    renamed = tmp_path / "renamed"
    renamed.mkdir()
    (renamed / "adapter_config.json").write_text((tmp_path / "ok" / "adapter_config.json").read_text())
    state = load_file(str(tmp_path / "ok" / "adapter_model.safetensors"))
    save_file({k.replace("q_proj", "query"): v for k, v in state.items()}, str(renamed / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=r"does not hold adapter 'default': 4 of its tensors missing \(e.g. \[.*q_proj.lora_A.default.*"
                                         r"4 unexpected \(e.g. \[.*query.*model.lora settings"):
        load_adapter_(apply_lora(tiny_lm(), lora_settings()), renamed)

    save_adapter(apply_lora(tiny_lm(), lora_settings(rank=2)), tmp_path / "rank2")
    with pytest.raises(ValueError, match=r"does not fit adapter 'default' \(size mismatch for .*lora_A.*model.lora settings \(rank"):
        load_adapter_(apply_lora(tiny_lm(), lora_settings()), tmp_path / "rank2")


def learner_models(*overrides):
    """The trainer's LearnerModels for configs/default.yaml with ``overrides``, built in this process (one CPU process)."""
    from crl.builders import build_tokenizer, sampling_spec
    from crl.training.accelerator import make_accelerator
    from crl.training.models import LearnerModels, build_policy_lm

    cfg = load_config(ROOT / "configs" / "default.yaml", list(overrides))
    codec = build_tokenizer(cfg)
    accelerator, ds_config = make_accelerator(cfg)
    return LearnerModels(cfg, build_policy_lm(cfg, codec, ds_config), sampling_spec(cfg, codec), accelerator, ds_config,
                         torch.device("cpu"))


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_the_learners_frozen_summariser_is_a_copy_only_without_lora(lora):
    """LearnerModels._frozen_summariser: with LoRA it computes with the policy's own base tensors (the same storage)
    and a frozen adapter, no copy of the model; without LoRA it is a frozen copy (other storage, the same values)."""
    from crl.modules.lora import FrozenAdapterLM

    models = learner_models(*(LORA if lora else []), "algo.frozen_summary=true")
    frozen = models._frozen_summariser()
    policy = dict(models.lm.named_parameters())
    if lora:
        assert isinstance(frozen, FrozenAdapterLM)
        used = parameters_computed_with(frozen, input_ids=torch.randint(2, 64, (2, 10)))
        base = {p.data_ptr() for n, p in policy.items() if "lora_" not in n}
        assert base <= used and all(".frozen." in n or "lora_" not in n for n, p in policy.items() if p.data_ptr() in used)
    else:
        own = dict(frozen.named_parameters())
        assert own.keys() == policy.keys() and not any(p.requires_grad for p in own.values())
        assert all(own[n].data_ptr() != p.data_ptr() and torch.equal(own[n], p) for n, p in policy.items())


def test_only_the_adapters_are_trained():
    from crl.builders import build_tokenizer
    from crl.training.models import build_policy_lm

    cfg = load_config(ROOT / "configs" / "default.yaml", LORA)
    lm = build_policy_lm(cfg, build_tokenizer(cfg), None)
    trained = [n for n, p in lm.named_parameters() if p.requires_grad]
    assert trained and all("lora_A" in n or "lora_B" in n for n in trained)
    n_layers = lm.config.num_hidden_layers
    assert len(trained) == 2 * 7 * n_layers  # A and B of the 7 default projections in every decoder layer


@pytest.mark.parametrize("override, message", [
    ("model.lora.rank=0", "model.lora.rank"),
    ("model.lora.dropout=1.0", "model.lora.dropout"),
    ("model.lora.dropout=0.1", r"model.lora.dropout.*must be 0, got 0.1: the sampler decodes with the adapters merged"),
    ("model.lora.target_modules=[]", "model.lora.target_modules"),
    ("deepspeed.config=configs/deepspeed/zero3.json", "ZeRO-3"),
])
def test_impossible_lora_configs_are_refused_at_load_time(override, message):
    with pytest.raises(ConfigValidationError, match=message):
        load_config(ROOT / "configs" / "default.yaml", LORA + [override])


def test_unknown_target_modules_name_the_model_layers():
    from crl.builders import build_tokenizer
    from crl.training.models import build_policy_lm

    cfg = load_config(ROOT / "configs" / "default.yaml", LORA + ["model.lora.target_modules=[c_attn]"])
    with pytest.raises(ConfigValidationError, match=r"\['c_attn'\] name no layer.*q_proj"):
        build_policy_lm(cfg, build_tokenizer(cfg), None)


# ------------------------------------------------------------------------------------------ through scripts/train.py
def _metrics(run_dir):
    keep = ("train/reward", "policy/approx_kl", "loss_objective", "loss_critic", "grad_norm/actor", "grad_norm/critic")
    return [{k: v for k, v in json.loads(line).items() if k in keep or k == "step"}
            for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_merged_adapter_sampling_gives_the_adapter_models_distribution_and_tokens(dtype):
    """The sampler's merged copy (crl.modules.lora.MergedAdapters) computes the peft model's next-token distributions
    up to the precision's rounding (bf16: both under bf16 autocast, within 2 bf16 ulps of a log-prob), shares the
    base tensors instead of copying them, and follows the adapters when refreshed (a stale copy is far off: checked).
    fp32: it draws the peft model's tokens with the same seed. (In bf16 the two round differently, about one ulp, so
    a draw near a boundary between two tokens may fall either way: the distributions are what is compared.)"""
    import contextlib

    from crl.modules.generation import TransformersBackend
    from crl.modules.lora import MergedAdapters
    from crl.sampling import SamplingSpec

    lm = perturbed_lora_lm().eval()
    merged = MergedAdapters(lm, dtype=dtype)
    base = lm.get_base_model()
    assert merged.model.model.embed_tokens.weight.data_ptr() == base.model.embed_tokens.weight.data_ptr()  # not copied
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if dtype == torch.bfloat16 else contextlib.nullcontext
    tol = 1e-5 if dtype == torch.float32 else 2 * torch.finfo(torch.bfloat16).eps
    ids = torch.randint(2, 64, (4, 40), generator=torch.Generator().manual_seed(0))

    def log_probs(model):
        with torch.no_grad(), autocast():
            return model(input_ids=ids).logits.float().log_softmax(-1)

    assert (log_probs(merged.model) - log_probs(lm)).abs().max() < tol
    with torch.no_grad():  # the adapters move (an update): the copy follows them only when refreshed
        for name, p in lm.named_parameters():
            if "lora_B" in name:
                p.mul_(-3.0)
    assert (log_probs(merged.model) - log_probs(lm)).abs().max() > 10 * tol
    merged.refresh()
    assert (log_probs(merged.model) - log_probs(lm)).abs().max() < tol
    if dtype == torch.float32:
        spec = SamplingSpec(1.0, 1.0, stop_token_ids=(1,))
        prompts = [[5, 9, 12, 3, 7, 7, 2], [11, 4]]
        a = TransformersBackend(merged.model, seed=11).generate(prompts, [24, 24], spec)
        b = TransformersBackend(lm, seed=11).generate(prompts, [24, 24], spec)
        assert [g.token_ids for g in a] == [g.token_ids for g in b] and sum(len(g.token_ids) for g in a) > 10
        assert [x for g in a for x in g.log_probs] == pytest.approx([x for g in b for x in g.log_probs], abs=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("arm", [[], ["algo.frozen_summary=true"]], ids=["joint", "frozen_summary"])
def test_a_lora_run_resumed_equals_an_uninterrupted_one_and_its_merged_policy_samples_the_adapter_models_tokens(tmp_path, arm):
    """(frozen_summary: the frozen summariser's adapter is saved and restored too; were it restarted from the policy's
    adapter on resume, the resumed run's summaries, and so its metrics, would differ.)"""
    from test_multirank import audit, launch

    from crl.modules.generation import TransformersBackend
    from crl.modules.lora import ADAPTER_DIR
    from crl.sampling import SamplingSpec

    straight, split = tmp_path / "straight", tmp_path / "split"
    launch(1, straight, *LORA, *arm, "train.iterations=3")
    launch(1, split, *LORA, *arm, "train.iterations=1")
    resumed = launch(1, split, *LORA, *arm, "train.iterations=3")
    assert "resumed from" in resumed.stdout
    assert _metrics(straight) == _metrics(split)
    audit(straight)
    audit(split)
    # scripts/evaluate.py on the last checkpoint (merged policy/, and the frozen adapter for frozen_summary) reproduces
    # the run's own last dev/success
    import importlib.util

    spec = importlib.util.spec_from_file_location("evaluate_script", ROOT / "scripts" / "evaluate.py")
    ev = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ev)
    logged = [r for r in (json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()) if "dev/success" in r][-1]
    assert ev.evaluate_checkpoint(straight, None, "dev", 4)["success"] == logged["dev/success"]

    # the last checkpoint: policy/ is a plain transformers model; the adapter loads onto the base with peft
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    last = sorted((straight / "checkpoints").glob("iter_*"))[-1]
    assert (last / ADAPTER_DIR / "adapter_config.json").is_file()
    merged = AutoModelForCausalLM.from_pretrained(last / "policy", local_files_only=True).eval()
    cfg = load_config(straight / "config.yaml")
    from crl.builders import build_tokenizer

    codec = build_tokenizer(cfg)
    base = build_causal_lm(cfg.model.preset, vocab_size=codec.vocab_size, max_positions=cfg.compaction.context_capacity,
                           eos_token_id=codec.eos_id, seed=cfg.train.seed)
    adapted = PeftModel.from_pretrained(base, last / ADAPTER_DIR).eval()
    lora_b = [p for n, p in adapted.named_parameters() if "lora_B" in n]
    assert any(p.abs().max() > 0 for p in lora_b), "the adapter never moved: the sampling comparison proves nothing"
    spec = SamplingSpec(1.0, 1.0, stop_token_ids=(codec.eos_id,))
    prompts = [codec.encode("there are 4 facts . remember them")[:12], codec.encode("fact")[:4]]
    a = TransformersBackend(merged, seed=11).generate(prompts, [16, 16], spec)
    b = TransformersBackend(adapted, seed=11).generate(prompts, [16, 16], spec)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    assert [x for g in a for x in g.log_probs] == pytest.approx([x for g in b for x in g.log_probs], abs=1e-4)


@pytest.mark.slow
def test_a_lora_resume_stops_when_model_preset_is_not_the_base_it_was_trained_on(tmp_path):
    """A LoRA checkpoint holds the adapter, and the base weights are rebuilt from model.preset: a preset directory
    re-imported with the same bytes resumes; one whose weights changed since stops the run with one line naming
    model.preset and the file that changed (the fingerprint in meta.json); and where no fingerprint was recorded (a
    checkpoint of an older crl), the merged weights themselves stop it, naming model.preset and the tensor."""
    import shutil

    from safetensors.torch import load_file, save_file
    from test_multirank import launch
    from test_train import tiny_checkpoint

    preset = tiny_checkpoint(tmp_path / "preset")
    run, args = tmp_path / "run", (*LORA, f"model.preset={preset}")
    launch(1, run, *args, "train.iterations=1")
    first = sorted((run / "checkpoints").glob("iter_*"))[-1]
    recorded = json.loads((first / "meta.json").read_text())["preset"]
    assert recorded["preset"] == str(preset) and recorded["sha256"] and "model.safetensors" in recorded["files"]

    shutil.copytree(preset, tmp_path / "reimport")  # the same bytes in new files: resumes
    shutil.rmtree(preset)
    shutil.copytree(tmp_path / "reimport", preset)
    assert "resumed from" in launch(1, run, *args, "train.iterations=2").stdout

    weights = load_file(str(preset / "model.safetensors"))
    weights["model.layers.0.self_attn.q_proj.weight"][0, 0] += 1e-3
    save_file(weights, str(preset / "model.safetensors"), metadata={"format": "pt"})
    stopped = launch(1, run, *args, "train.iterations=3", check=False)
    last = sorted((run / "checkpoints").glob("iter_*"))[-1]
    assert stopped.returncode == 1 and stopped.stderr.strip().splitlines()[-1].startswith(
        f"error: model.preset={preset} is not the preset {last} was trained from: model.safetensors changed (SHA-256 "
    ), stopped.stderr[-2000:]

    meta = json.loads((last / "meta.json").read_text())
    del meta["preset"]  # as a checkpoint written before the fingerprint was recorded
    (last / "meta.json").write_text(json.dumps(meta))
    stopped = launch(1, run, *args, "train.iterations=3", check=False)
    line = stopped.stderr.strip().splitlines()[-1]
    assert stopped.returncode == 1 and line.startswith(
        f"error: model.preset={preset} is not the base model {last} was trained on: with the checkpoint's adapter, its merged weights "
        "differ from policy/model.safetensors in 1 tensor(s), e.g. model.layers.0.self_attn.q_proj.weight: differs by up to 0.001"
    ), stopped.stderr[-2000:]
    assert f"model.preset={last / 'policy'}" in line
    assert [r["step"] for r in _metrics(run) if r["step"] > 0] == [1, 2]  # the stopped resumes trained nothing


@pytest.mark.processes
def test_lora_trains_under_zero2_on_two_ranks_resumes_and_passes_the_audit(tmp_path):
    from test_multirank import audit, launch

    run = tmp_path / "run"
    launch(2, run, *LORA, "train.iterations=1", deepspeed=2)
    resumed = launch(2, run, *LORA, "train.iterations=2", deepspeed=2)
    assert "resumed from" in resumed.stdout
    assert [r["step"] for r in _metrics(run) if r["step"] > 0] == [1, 2]
    audit(run)
    # the actor's optimizer state is the adapters' only: ZeRO keeps the trained tensors flat, split over the ranks, and
    # the two partitions together hold exactly the adapter's elements (with the base model: 17x as many), each with its
    # Adam moments
    from safetensors.torch import load_file

    from crl.modules.lora import ADAPTER_DIR

    last = sorted((run / "checkpoints").glob("iter_*"))[-1]
    adapter = load_file(str(last / ADAPTER_DIR / "adapter_model.safetensors"))
    held = 0
    for rank in (0, 1):
        zero = torch.load(last / "optimizer" / f"actor_rank{rank}.pt", weights_only=False)["zero"]
        flat = zero["single_partition_of_fp32_groups"]
        moments = zero["base_optimizer_state"]["state"]
        assert len(moments) == len(flat) and all(moments[i][m].numel() >= t.numel() for i, t in enumerate(flat)
                                                 for m in ("exp_avg", "exp_avg_sq"))
        held += sum(t.numel() for t in flat)
    assert held == sum(t.numel() for t in adapter.values()), (held, sum(t.numel() for t in adapter.values()))


@pytest.mark.real_model
@pytest.mark.parametrize("arm", ["joint", "frozen"])
def test_the_lm_lora_configs_load_and_fit_their_token_budgets_with_smollm2(smollm2_dir, arm):
    """`make train-lm`'s config and its control: valid at load time and within their token budgets (Eqs. 7-9) with the
    real tokenizer and chat template — what a Trainer checks before it writes anything."""
    from crl.builders import build_prompt_format, build_tokenizer, check_budgets

    cfg = load_config(ROOT / "configs" / "lm_lora" / f"{arm}.yaml", [f"model.preset={smollm2_dir}"])
    assert cfg.model.lora.enabled and cfg.algo.frozen_summary == (arm == "frozen")
    codec = build_tokenizer(cfg)
    check_budgets(cfg, codec, build_prompt_format(cfg, codec))
