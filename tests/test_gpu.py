"""GPU correctness (``pytest -m gpu``; every test skips without CUDA). Run by scripts/gpu_check.sh.

Tolerances (stated, not tuned on a GPU: none was available when these were written):
* generation log-probs = teacher forcing on GPU: fp32 <= 1e-4 (max abs); bf16 <= 0.1 max abs and <= 0.02 mean
  abs (bf16 has ~3 significant digits; incremental KV-cache decoding and one full forward round differently).
* estimator on GPU = on CPU (float64 and float32 inputs): <= 1e-6 / 1e-5.
* one PPO loss + backward on GPU = CPU (fp32): losses <= 1e-4 relative, gradients <= 1e-3 relative (norm).
"""
import pytest
import torch
from tensordict import TensorDict

from crl.episode import concat_episodes
from crl.modules.generation import TransformersBackend
from crl.modules.networks import CausalLMLogProbs, ValueModel, actor_module, build_causal_lm, critic_module
from crl.objectives import CompactionPPOLoss, CrossTrajectoryGAE
from crl.sampling import SamplingSpec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
V, EOS = 64, 2


def lm_on(device, dtype=torch.float32, seed=3):
    return build_causal_lm("llama-small", vocab_size=V, max_positions=512, eos_token_id=EOS, seed=seed).to(device=device,
                                                                                                           dtype=dtype).eval()


@pytest.mark.parametrize("dtype,max_tol,mean_tol", [(torch.float32, 1e-4, 1e-5), (torch.bfloat16, 0.1, 0.02)], ids=["fp32", "bf16"])
def test_generation_log_probs_equal_teacher_forcing_on_gpu(dtype, max_tol, mean_tol):
    lm = lm_on("cuda", dtype)
    backend = TransformersBackend(lm, seed=7, device="cuda")
    prompts = [[1, 5, 6, 7, 8, 9, 10], [1, 8], [1, 9, 9, 9, 3, 4, 5, 6, 7, 8, 9]]
    params = SamplingSpec(temperature=0.8, stop_token_ids=(EOS,))
    gens = backend.generate(prompts, [24, 16, 8], params, cache_keys=[0, 1, 2])
    ext = prompts[0] + gens[0].token_ids + [11, 12, 13]
    gens.append(backend.generate([ext], [12], params, cache_keys=[0])[0])  # through the prefix cache
    rows = [p + g.token_ids for p, g in zip(prompts + [ext], gens)]
    width = max(map(len, rows))
    tokens = torch.zeros(len(rows), width, dtype=torch.long, device="cuda")
    mask = torch.zeros_like(tokens)
    for i, r in enumerate(rows):
        tokens[i, : len(r)], mask[i, : len(r)] = torch.tensor(r, device="cuda"), 1
    with torch.no_grad():
        log_prob, _ = CausalLMLogProbs(lm, temperature=0.8)(tokens, mask)
    diffs = []
    for i, (p, g) in enumerate(zip(prompts + [ext], gens)):
        ref = log_prob[i, len(p): len(p) + len(g.token_ids)].float().cpu()
        diffs.append((torch.tensor(g.log_probs) - ref).abs())
    d = torch.cat(diffs)
    assert d.max() <= max_tol and d.mean() <= mean_tol, f"{dtype}: max {d.max():.2e} mean {d.mean():.2e}"


def _batch(seed=0):
    from test_ppo_loss import make_rollout

    g = torch.Generator().manual_seed(seed)
    return concat_episodes([make_rollout(r, 1 + r % 3, g, float(r % 2)) for r in range(8)])


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-6), (torch.float32, 1e-5)])
def test_estimator_on_gpu_equals_cpu(dtype, tol):
    td = _batch(1)
    g = torch.Generator().manual_seed(2)
    td["state_value"] = torch.where(td["loss_mask"], torch.randn(td["loss_mask"].shape, generator=g, dtype=dtype), 0.0)
    td["reward"] = td["reward"].to(dtype)
    for lambda_length in ("segment", "rollout"):
        est = CrossTrajectoryGAE(gamma=1.0, alpha=1.5, lambda_length=lambda_length)
        cpu = est(td.clone())
        gpu = est(td.clone().to("cuda"))
        assert gpu["advantage"].device.type == "cuda"
        for key in ("advantage", "value_target"):
            torch.testing.assert_close(gpu[key].cpu(), cpu[key], atol=tol, rtol=tol)


def test_ppo_loss_and_backward_on_gpu_equal_cpu():
    td = _batch(3)
    results = {}
    for device in ("cpu", "cuda"):
        lm = lm_on(device).train()
        critic_net = ValueModel.from_actor(lm).to(device)
        with torch.no_grad():
            critic_net.value_head.weight.normal_(0, 0.1, generator=torch.Generator(device=device).manual_seed(0))
        actor, critic = actor_module(lm, 0.9), critic_module(critic_net)
        batch = td.clone().to(device)
        with torch.no_grad():
            lp = actor(batch.select("tokens", "attention_mask"))["log_prob"]
        noise = 0.2 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(4)).to(device)
        batch["sample_log_prob"] = torch.where(batch["loss_mask"], lp + noise, 0.0)
        CrossTrajectoryGAE(gamma=1.0, alpha=1.5, lambda_length="rollout", value_network=critic)(batch)
        loss = CompactionPPOLoss(actor, critic, clip_value=0.5, entropy_coeff=0.01)
        out = loss(batch)
        total = sum(v for k, v in out.items() if k.startswith("loss_"))
        total.backward()
        grads = torch.cat([p.grad.flatten().cpu() for p in list(lm.parameters()) + list(critic_net.parameters()) if p.grad is not None])
        results[device] = ({k: float(v) for k, v in out.items() if k.startswith("loss_")}, grads)
    (l_cpu, g_cpu), (l_gpu, g_gpu) = results["cpu"], results["cuda"]
    for k in l_cpu:
        assert abs(l_cpu[k] - l_gpu[k]) <= 1e-4 * max(1.0, abs(l_cpu[k])), (k, l_cpu[k], l_gpu[k])
    assert (g_cpu - g_gpu).norm() <= 1e-3 * g_cpu.norm()
