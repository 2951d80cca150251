"""bf16 parity with the Hugging Face peers, on every device present (the CPU always; CUDA when there is one).

What `Trainer(bf16=True)` runs — bf16 autocast over float32 weights, archlab in training mode, so its LM head is the
chunked, fused loss — against the stock model with the same weights (LlamaForCausalLM, MixtralForCausalLM,
MarianMTModel, converted as a user would with `convert_checkpoint`): the losses agree to bf16 precision, and so do
the gradients of every parameter the two name alike. Then both in bf16 weights for
serving: archlab's greedy generation is the peer's, up to bf16 ties — at every step archlab's token scores within
bf16 rounding of the peer's best token under the peer itself. (fp32 parity, exact to 1e-4, is tested per family in
tests/conversion/test_families.py.)
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    LlamaConfig,
    LlamaForCausalLM,
    MarianConfig,
    MarianMTModel,
    MixtralConfig,
    MixtralForCausalLM,
)

import archlab  # noqa: F401  (registers the Auto classes the converted folders load through)
from archlab.conversion import convert_checkpoint

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
VOCAB = 101
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
DECODER = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    **IDS,
)
PEERS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**DECODER)),
    "mixtral": lambda: MixtralForCausalLM(MixtralConfig(**DECODER, num_local_experts=4, num_experts_per_tok=2)),
    "marian": lambda: MarianMTModel(
        MarianConfig(
            vocab_size=VOCAB,
            d_model=64,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=128,
            decoder_ffn_dim=128,
            max_position_embeddings=128,
            dropout=0.0,
            decoder_start_token_id=0,
            **IDS,
        )
    ),
}


def _pair(name: str, tmp_path) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    peer = PEERS[name]()
    with torch.no_grad():  # weights far from init, so the comparison is not between two near-uniform outputs
        for parameter in peer.parameters():
            if parameter.requires_grad:  # not Marian's fixed sinusoidal table
                parameter.add_(torch.randn_like(parameter) * 0.05)
    peer.save_pretrained(tmp_path / "stock")
    convert_checkpoint(tmp_path / "stock", tmp_path / "archlab")
    auto = AutoModelForSeq2SeqLM if name == "marian" else AutoModelForCausalLM
    return auto.from_pretrained(tmp_path / "archlab"), peer


def _batch(name: str, device: str) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (4, 48), generator=generator)
    if name == "marian":
        return {"input_ids": ids.to(device), "labels": torch.randint(3, VOCAB, (4, 24), generator=generator).to(device)}
    return {"input_ids": ids.to(device), "labels": ids.to(device)}


def _loss_and_grads(model: torch.nn.Module, batch: dict, device: str, bf16: bool) -> tuple[torch.Tensor, dict]:
    model.train()
    model.zero_grad()
    with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
        loss = model(**batch).loss
    loss.backward()
    return loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(PEERS))
def test_bf16_autocast_training_loss_and_gradients_match_the_peer(name, device, tmp_path):
    """bf16 precision is measured, not guessed: the peer's own bf16 gradients differ from its fp32 ones by some
    amount per parameter; archlab's bf16 gradients must be at most 3x that far from the peer's (independent
    rounding on both sides gives about 1.4x; a real difference, orders of magnitude more)."""
    ours, peer = (m.to(device) for m in _pair(name, tmp_path))
    assert ours.config.lm_loss_chunk_size > 0  # the fused loss is what runs in training
    batch = _batch(name, device)
    loss, grads = _loss_and_grads(ours, batch, device, bf16=True)
    peer_loss, peer_grads = _loss_and_grads(peer, batch, device, bf16=True)
    _, peer_fp32_grads = _loss_and_grads(peer, batch, device, bf16=False)
    torch.testing.assert_close(loss, peer_loss, rtol=1e-2, atol=0)
    shared = [n for n in grads if n in peer_grads and grads[n].shape == peer_grads[n].shape]
    assert len(shared) >= 0.9 * len(grads)  # the peers name (almost) every parameter as archlab does
    for n in shared:
        bf16_noise = (peer_grads[n] - peer_fp32_grads[n]).norm()
        allowed = 3 * bf16_noise + 1e-6 * peer_grads[n].norm()
        assert (grads[n] - peer_grads[n]).norm() <= allowed, (
            f"{n}: {(grads[n] - peer_grads[n]).norm():.3g} > {allowed:.3g}"
        )


def _peer_logits(peer: torch.nn.Module, prompt: torch.Tensor, generated: torch.Tensor, seq2seq: bool) -> torch.Tensor:
    """The peer's logits for each token archlab generated, teacher-forced on archlab's own sequence."""
    if seq2seq:
        return peer(input_ids=prompt, decoder_input_ids=generated[:, :-1]).logits.float()
    return peer(generated[:, :-1]).logits[:, prompt.shape[1] - 1 :].float()


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(PEERS))
def test_bf16_greedy_generation_is_the_peers_up_to_ties(name, device, tmp_path):
    """Both models in bf16 weights, as served. Each token archlab picks is scored under the peer: it is the peer's
    argmax, or behind it by no more than bf16 rounding — measured as 3x how far the peer's own bf16 logits are
    from its fp32 logits at that step (two independent roundings give about 1.4x)."""
    ours, peer = _pair(name, tmp_path)
    peer_fp32 = peer.to(device).eval()
    peer = copy.deepcopy(peer_fp32).to(torch.bfloat16)
    ours = ours.to(device, torch.bfloat16).eval()
    prompt = _batch(name, device)["input_ids"][:2, :16]
    kwargs = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    seq2seq = name == "marian"
    with torch.no_grad():
        generated = ours.generate(prompt, **kwargs)
        logits = _peer_logits(peer, prompt, generated, seq2seq)
        exact = _peer_logits(peer_fp32, prompt, generated, seq2seq)
    chosen = generated[:, 1:] if seq2seq else generated[:, prompt.shape[1] :]
    logits[..., IDS["eos_token_id"]] = float("-inf")  # as generate's min_new_tokens masks it
    gap = logits.max(-1).values - logits.gather(-1, chosen[..., None]).squeeze(-1)
    bf16_noise = (logits - exact).abs().amax(-1)
    assert bool((gap <= 3 * bf16_noise).all()), f"gaps {gap} vs bf16 noise {bf16_noise}"
    assert bool((gap == 0).float().mean() >= 0.75)  # and mostly exactly the peer's token: not a loose check
