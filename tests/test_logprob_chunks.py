"""CausalLMLogProbs' chunked, checkpointed log-probs (chunked_log_probs over SamplingSpec.log_probs) = the
full-vocabulary reference, at top_p = 1 and with top-p truncation and suppressed ids."""
import pytest
import torch

from crl.modules.networks import CausalLMLogProbs, _shift, build_causal_lm, chunked_log_probs
from crl.sampling import SamplingSpec

SPECS = [SamplingSpec(temperature=0.7), SamplingSpec(temperature=1.0), SamplingSpec(temperature=0.7, top_p=0.8, suppress_ids=(3, 4))]


def reference(logits, tokens, spec):
    """Unchunked: the spec's [B, T, V] log-probs at once; a token outside the distribution has log-prob 0 here (and
    in the compared output) so that values and gradients compare as finite numbers."""
    logp_all = _shift(spec.log_probs(logits))
    lp = logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return lp.masked_fill(torch.isneginf(lp), 0.0), -(logp_all.exp() * logp_all.masked_fill(torch.isneginf(logp_all), 0.0)).sum(-1)


@pytest.mark.parametrize("chunk", [1, 3, 7, 128])
@pytest.mark.parametrize("spec", SPECS, ids=["t0.7", "t1", "t0.7-top_p0.8-suppress"])
def test_chunked_values_and_gradients_equal_the_full_log_softmax(chunk, spec):
    g = torch.Generator().manual_seed(chunk)
    logits = (3 * torch.randn(3, 11, 257, generator=g)).requires_grad_()
    tokens = torch.randint(0, 257, (3, 11), generator=g)
    w1, w2 = torch.randn(3, 11, generator=g), torch.randn(3, 11, generator=g)
    lp_ref, ent_ref = reference(logits, tokens, spec)
    (g_ref,) = torch.autograd.grad((lp_ref * w1 + ent_ref * w2).sum(), logits)
    lp, ent = chunked_log_probs(logits, tokens, spec, chunk)
    lp = lp.masked_fill(torch.isneginf(lp), 0.0)
    (g_new,) = torch.autograd.grad((lp * w1 + ent * w2).sum(), logits)
    torch.testing.assert_close(lp, lp_ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(ent, ent_ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(g_new, g_ref, atol=1e-6, rtol=0)
    assert (lp[:, 0] == 0).all() and (ent[:, 0] == 0).all()


def test_actor_fast_path_equals_the_reference_on_a_model():
    lm = build_causal_lm("llama-tiny", vocab_size=50, max_positions=64, seed=2)
    tokens = torch.randint(1, 50, (2, 20), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(tokens)
    mask[1, 15:] = 0
    actor = CausalLMLogProbs(lm, temperature=0.9)
    actor.chunk_size = 6
    lp, ent = actor(tokens, mask)
    logits = lm(input_ids=tokens, attention_mask=mask).logits
    lp_ref, ent_ref = reference(logits, tokens, SamplingSpec(temperature=0.9))
    keep = mask.bool().clone()
    keep[:, 0] = False
    torch.testing.assert_close(lp, lp_ref * keep, atol=1e-6, rtol=0)
    torch.testing.assert_close(ent, ent_ref * keep, atol=1e-6, rtol=0)
    (lp.sum() + ent.sum()).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in lm.parameters() if p.requires_grad)
