"""fastrpe.hf: DecoderLM as transformers models (config, Auto classes, save/load, generate, Trainer).

Every model here is tiny and randomly initialized from a config (transformers ships no weights).
References: `DecoderLM.generate` / `DecoderLM.forward` (fastrpe's own paths) and, for beam search,
a beam search written here over float64 full-sequence forwards (no cache, no state reordering).
"""
from __future__ import annotations

import copy
import inspect
import json
import math
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from transformers import (AutoConfig, AutoModel, AutoModelForCausalLM,  # noqa: E402
                          AutoModelForSequenceClassification, GenerationMixin, Trainer, TrainingArguments)

import fastrpe.hf as H  # noqa: E402
from fastrpe import FastRPEError  # noqa: E402
from fastrpe.nn import BandState, KVCache, LinearState, SoEState  # noqa: E402
from fastrpe.nn.block import init_weights  # noqa: E402

V = 259
# (kernel, position, the decode state `decoder()` picks): a KV cache and two constant-size states
CASES = [("softmax", "kerple_log", KVCache), ("nprf", "alibi", LinearState), ("elu", "t5", BandState)]
IDS = [f"{k}-{p}" for k, p, _ in CASES]
# the name `generate` passes the cache under and returns it under: "cache" from transformers 5.24,
# "past_key_values" before (read from transformers itself, not from fastrpe.hf.CACHE_NAME)
CACHE = "cache" if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters \
    else "past_key_values"


def tiny(kernel="nprf", position="alibi", *, seed=0, std=0.3, cls=None, **kw):
    """A tiny model; weights drawn with `std` (larger than the default 0.02, so that tokens and
    beams are far from ties and greedy decoding does not repeat one token)."""
    cfg = H.FastRPEConfig(vocab_size=V, d_model=32, n_heads=2, n_layers=2, kernel=kernel, position=position, **kw)
    torch.manual_seed(seed)
    model = (cls or H.FastRPEForCausalLM)(cfg)
    init_weights(model.model, std=std)
    return model.eval()


def prompt(B=2, P=7, seed=1):
    return torch.randint(0, 256, (B, P), generator=torch.Generator().manual_seed(seed))


# --- config and registration -------------------------------------------------------------------

def test_config_round_trips_and_maps_to_lm_config(tmp_path):
    cfg = H.FastRPEConfig(d_model=48, n_heads=3, n_layers=3, kernel="nprf", position="kerple_power",
                          backend="dense", max_len=333, num_features=20, feature_seed=7, dropout=0.1)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_hidden_layers, cfg.max_position_embeddings) == \
        (48, 3, 3, 333)
    cfg.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "fastrpe" and saved["kernel"] == "nprf" and saved["position"] == "kerple_power"
    back = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(back, H.FastRPEConfig)
    assert back.to_lm_config() == cfg.to_lm_config()
    lm = cfg.to_lm_config()
    assert (lm.d_model, lm.n_heads, lm.n_layers, lm.kernel, lm.position, lm.backend, lm.max_len, lm.num_features,
            lm.feature_seed, lm.dropout) == (48, 3, 3, "nprf", "kerple_power", "dense", 333, 20, 7, 0.1)
    assert H.FastRPEConfig.from_lm_config(lm).to_lm_config() == lm


@pytest.mark.parametrize("bad,field", [
    (dict(kernel="nope"), "kernel"), (dict(position="nope"), "position"), (dict(d_model=30, n_heads=4), "d_model"),
    (dict(dropout=1.5), "dropout"), (dict(backend="nope"), "backend"), (dict(num_features=0), "num_features"),
    (dict(tie_word_embeddings=False), "tie_word_embeddings"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_config_refuses_invalid_fields_naming_them(bad, field):
    with pytest.raises(FastRPEError, match=f"FastRPEConfig: field '{field}'") as e:
        H.FastRPEConfig(**bad)
    assert "\n" not in str(e.value)


def test_auto_classes_after_import():
    cfg = AutoConfig.for_model("fastrpe", d_model=32, n_heads=2, n_layers=1)
    assert isinstance(cfg, H.FastRPEConfig)
    assert type(AutoModelForCausalLM.from_config(cfg)) is H.FastRPEForCausalLM
    assert type(AutoModelForSequenceClassification.from_config(cfg)) is H.FastRPEForSequenceClassification
    assert type(AutoModel.from_config(cfg)) is H.FastRPEModel


def test_import_fastrpe_does_not_import_transformers():
    code = "import sys, fastrpe, fastrpe.nn; assert 'transformers' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_fastrpe_hf_without_transformers_says_how_to_install():
    code = ("import sys; sys.modules['transformers'] = None\n"
            "try:\n    import fastrpe.hf\nexcept Exception as e:\n    print(type(e).__name__ + ': ' + str(e))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.strip()
    assert out.startswith("FastRPEError") and "pip install fastrpe[hf]" in out and "\n" not in out


# --- weights: the wrapped DecoderLM, save/load ---------------------------------------------------

@pytest.mark.parametrize("kernel,position,_", CASES, ids=IDS)
def test_save_pretrained_from_pretrained_bit_identical_logits(tmp_path, kernel, position, _):
    model = tiny(kernel, position)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file() and not list(tmp_path.glob("*.bin"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is H.FastRPEForCausalLM
    x = prompt(2, 63)
    with torch.no_grad():
        assert torch.equal(model(x).logits, loaded(x).logits)
    sd, sd2 = model.state_dict(), loaded.state_dict()
    assert sd.keys() == sd2.keys() and all(torch.equal(sd[k], sd2[k]) for k in sd)
    assert loaded.model.head.weight is loaded.model.embed.weight  # still tied


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
def test_from_pretrained_dtype_casts_every_tensor_like_to(tmp_path, dtype):
    model = tiny("nprf", "kerple_log")
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype).eval()
    assert {t.dtype for t in loaded.state_dict().values()} == {dtype}  # positional terms too
    x = prompt(2, 9)
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model.to(dtype)(x).logits)


def test_forward_is_decoderlm_and_loss_is_next_token_cross_entropy():
    model = tiny("nprf", "kerple_log")
    x = prompt(3, 21)
    out = model(x, labels=x)
    assert torch.equal(out.logits, model.model(x))
    loss, logits = model(x, labels=x, return_dict=False)
    assert torch.equal(loss, out.loss) and torch.equal(logits, out.logits)
    ref = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, V).double(), x[:, 1:].reshape(-1).long())
    torch.testing.assert_close(out.loss.double(), ref, rtol=1e-6, atol=1e-6)
    labels = x.clone()
    labels[:, :5] = -100  # ignored targets
    ref = torch.nn.functional.cross_entropy(out.logits[:, 4:-1].reshape(-1, V).double(), x[:, 5:].reshape(-1))
    torch.testing.assert_close(model(x, labels=labels).loss.double(), ref, rtol=1e-6, atol=1e-6)


def test_cache_name_is_the_one_generate_uses():
    assert H.CACHE_NAME == CACHE


@pytest.mark.parametrize("keyword", ["cache", "past_key_values"])  # the name from transformers 5.24, before
@pytest.mark.parametrize("kernel,position,state", CASES, ids=IDS)
def test_cached_forward_token_by_token_equals_full_forward_float64(kernel, position, state, keyword):
    model = tiny(kernel, position).double()
    x = prompt(2, 12)
    full = model(x).logits
    cache = model.new_cache()
    parts = [model(x[:, :5], **{keyword: cache}).logits]
    for t in range(5, 12):
        out = model(x[:, t:t + 1], attention_mask=torch.ones(2, t + 1), **{keyword: cache})
        assert getattr(out, CACHE) is cache and cache.get_seq_length() == t + 1
        parts.append(out.logits)
    assert all(type(s) is state for s in cache.states)
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-9, atol=1e-9)


# --- generate -------------------------------------------------------------------------------------

@pytest.mark.parametrize("P", [1, 7])
@pytest.mark.parametrize("kernel,position,_", CASES, ids=IDS)
def test_generate_greedy_equals_fastrpe_generate(kernel, position, _, P):
    model = tiny(kernel, position)
    x = prompt(2, P)
    ours = model.model.generate(x, 12)
    theirs = model.generate(x, max_new_tokens=12, do_sample=False)
    assert torch.equal(theirs, ours)
    assert len(set(ours[:, P:].flatten().tolist())) > 2  # not one repeated token
    if P > 1:  # without a cache: a full forward per token
        assert torch.equal(model.generate(x, max_new_tokens=12, do_sample=False, use_cache=False), ours)


@pytest.mark.parametrize("temperature,top_k", [(0.8, 20), (1.0, None)])
@pytest.mark.parametrize("kernel,position,_", CASES[:2], ids=IDS[:2])
def test_generate_sampling_equals_fastrpe_sampling(kernel, position, _, temperature, top_k):
    model = tiny(kernel, position)
    x = prompt(2, 5)
    torch.manual_seed(11)
    ours = model.model.generate(x, 10, temperature=temperature, top_k=top_k)
    torch.manual_seed(11)
    theirs = model.generate(x, max_new_tokens=10, do_sample=True, temperature=temperature, top_k=top_k or 0,
                            top_p=1.0)
    assert torch.equal(theirs, ours)
    torch.manual_seed(12)
    other = model.generate(x, max_new_tokens=10, do_sample=True, temperature=temperature, top_k=top_k or 0)
    assert not torch.equal(other, ours)  # the seed matters: it is sampling


def reference_beam_search(lm, tokens, beams: int, steps: int):
    """Beam search over full-sequence forwards in float64: keep the `beams` best continuations by
    summed log-probability. Returns the best sequence, its score, and the smallest margin between
    a kept and a dropped candidate (or between the two best at the end)."""
    lm = copy.deepcopy(lm).double()
    seqs, scores, margin = tokens[None], torch.zeros(1, dtype=torch.float64), math.inf
    with torch.no_grad():
        for _ in range(steps):
            logp = lm(seqs)[:, -1].log_softmax(-1)  # (n, V)
            top = (scores[:, None] + logp).flatten().topk(beams + 1)
            margin = min(margin, float(top.values[beams - 1] - top.values[beams]))
            keep = top.indices[:beams]
            seqs = torch.cat([seqs[keep // V], (keep % V)[:, None]], 1)
            scores = top.values[:beams]
    return seqs[0], scores[0], min(margin, float(scores[0] - scores[1]))


@pytest.mark.parametrize("kernel,position,_", CASES, ids=IDS)
def test_beam_search_best_beam_equals_reference(kernel, position, _):
    model = tiny(kernel, position)
    x = prompt(2, 6)
    out = model.generate(x, max_new_tokens=5, num_beams=3, do_sample=False, length_penalty=0.0,
                         early_stopping=True, return_dict_in_generate=True, output_scores=True)
    assert isinstance(getattr(out, CACHE), H.FastRPECache)
    for b in range(2):
        best, score, margin = reference_beam_search(model.model, x[b], beams=3, steps=5)
        assert margin > 1e-4, "premise: the reference has no near-ties"
        assert torch.equal(out.sequences[b], best)
        assert abs(float(out.sequences_scores[b]) - float(score)) < 1e-4
    greedy = model.generate(x, max_new_tokens=5, do_sample=False)
    assert not torch.equal(greedy, out.sequences), "beam search found nothing greedy did not: a weak case"


@pytest.mark.parametrize("kernel,position,state", CASES, ids=IDS)
def test_generate_keeps_the_decode_state_decoder_picks(kernel, position, state):
    model = tiny(kernel, position)
    assert all(blk.attn.decoder().name == {KVCache: "kv", LinearState: "linear", BandState: "band"}[state]
               for blk in model.model.blocks)
    sizes = {}
    for n in (2, 24):
        out = model.generate(prompt(2, 4), max_new_tokens=n, do_sample=False, return_dict_in_generate=True)
        cache = getattr(out, CACHE)
        assert isinstance(cache, H.FastRPECache) and all(type(s) is state for s in cache.states)
        assert cache.get_seq_length() == 4 + n - 1
        sizes[n] = cache.nbytes()
    if state is LinearState:
        assert sizes[2] == sizes[24]  # constant size: does not grow with the length
    elif state is KVCache:
        assert sizes[24] > sizes[2]


def test_generate_with_the_soe_backend_keeps_soe_states_and_equals_fastrpe():
    model = tiny("nprf", "kerple_log", backend="soe")
    x = prompt(2, 6)
    out = model.generate(x, max_new_tokens=10, do_sample=False, return_dict_in_generate=True)
    assert all(type(s) is SoEState for s in getattr(out, CACHE).states)
    assert torch.equal(out.sequences, model.model.generate(x, 10))
    beams = model.generate(x, max_new_tokens=4, num_beams=3, do_sample=False, length_penalty=0.0)
    assert beams.shape == (2, 10)


def test_generate_refuses_a_dynamic_cache_and_padded_prompts():
    from transformers import DynamicCache

    model = tiny()
    x = prompt(2, 5)
    with pytest.raises(FastRPEError, match=f"{CACHE} must be a FastRPECache"):
        model.generate(x, max_new_tokens=2, **{CACHE: DynamicCache()})
    x[0, :2] = 256
    model.generation_config.pad_token_id = 256
    with pytest.raises(FastRPEError, match="attention_mask has padding"):
        model.generate(x, max_new_tokens=2, do_sample=False)


# --- padding and unsupported arguments -----------------------------------------------------------

def test_right_padding_is_exact_and_left_padding_is_refused():
    model = tiny("nprf", "kerple_log")
    x = prompt(2, 9)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    padded = model(x, attention_mask=mask).logits
    torch.testing.assert_close(padded[1, :6], model(x[1:, :6]).logits[0], rtol=1e-5, atol=1e-5)
    left = mask.flip(1)
    with pytest.raises(FastRPEError, match="only right padding"):
        model(x, attention_mask=left)
    with pytest.raises(FastRPEError, match="attention_mask has padding"):
        model(x, attention_mask=mask, use_cache=True)
    with pytest.raises(FastRPEError, match=r"attention_mask must be \[2, 9\]"):
        model(x, attention_mask=mask[:, :5])
    with pytest.raises(FastRPEError, match=r"attention_mask must be \[2, 9\] .*, got \(1, 9\)"):
        model(x, attention_mask=mask[:1])


@pytest.mark.parametrize("kwargs,match", [
    (dict(inputs_embeds=torch.zeros(1, 3, 32)), "inputs_embeds is not supported"),
    (dict(output_attentions=True), "output_attentions is not supported"),
    (dict(output_hidden_states=True), "output_hidden_states is not supported"),
    (dict(position_ids=torch.arange(3)[None]), "position_ids is not supported"),
    (dict(bogus=1), "unexpected argument 'bogus'"),
    (dict(past_key_values=(1, 2)), "past_key_values must be a FastRPECache"),
    (dict(cache=(1, 2)), "cache must be a FastRPECache"),
    (dict(cache=H.FastRPECache(2), past_key_values=H.FastRPECache(2)), "got both cache and past_key_values"),
], ids=["inputs_embeds", "output_attentions", "output_hidden_states", "position_ids", "unknown", "tuple_cache",
        "tuple_cache_new_name", "both_cache_names"])
def test_unsupported_arguments_raise_one_line(kwargs, match):
    model = tiny()
    with pytest.raises(FastRPEError, match=match) as e:
        model(torch.zeros(1, 3, dtype=torch.long), **kwargs)
    assert "\n" not in str(e.value)
    with pytest.raises(FastRPEError, match="input_ids holds id 300"):
        model(torch.full((1, 3), 300))


def test_cache_reorders_and_crops_states():
    model = tiny("softmax", "kerple_log")
    x = prompt(3, 6)
    cache = model.new_cache()
    model(x, past_key_values=cache)
    k0 = cache.states[0].k.clone()
    cache.reorder_cache(torch.tensor([2, 2, 0]))
    assert torch.equal(cache.states[0].k, k0[[2, 2, 0]]) and cache.batch_size == 3
    cache.batch_repeat_interleave(2)
    assert torch.equal(cache.states[0].k, k0[[2, 2, 2, 2, 0, 0]])
    cache.crop(-2)
    assert cache.get_seq_length() == 4 and torch.equal(cache.states[0].k, k0[[2, 2, 2, 2, 0, 0], :, :4])
    lin = tiny("nprf", "alibi")
    cache = lin.new_cache()
    lin(x, past_key_values=cache)
    cache.crop(0)
    with pytest.raises(FastRPEError, match="cannot forget tokens"):
        cache.crop(-1)
    with pytest.raises(FastRPEError, match="update\\(keys, values\\) is not supported"):
        cache.update(torch.zeros(1), torch.zeros(1), 0)


# --- other heads --------------------------------------------------------------------------------

def test_sequence_classification_head_forward_loss_and_padding(tmp_path):
    model = tiny("nprf", "alibi", cls=H.FastRPEForSequenceClassification, num_labels=3, pad_token_id=256)
    x = prompt(3, 10)
    x[2, 7:] = 256  # right padding by pad_token_id
    labels = torch.tensor([0, 2, 1])
    out = model(x, labels=labels)
    assert out.logits.shape == (3, 3)
    torch.testing.assert_close(out.loss, torch.nn.functional.cross_entropy(out.logits, labels))
    torch.testing.assert_close(out.logits[2], model(x[2:, :7]).logits[0], rtol=1e-5, atol=1e-5)
    out.loss.backward()
    assert model.score.weight.grad.abs().sum() > 0 and model.model.embed.weight.grad.abs().sum() > 0
    reg = tiny(cls=H.FastRPEForSequenceClassification, num_labels=1)
    y = torch.randn(3)
    r = reg(x[:, :7], labels=y)
    torch.testing.assert_close(r.loss, torch.nn.functional.mse_loss(r.logits.squeeze(-1), y))
    model.save_pretrained(tmp_path)
    back = AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    assert torch.equal(back(x).logits, model(x).logits)


def test_base_model_hidden_states_give_the_lm_logits(tmp_path):
    lm = tiny("softmax", "rotary")
    lm.save_pretrained(tmp_path)
    base = AutoModel.from_pretrained(tmp_path).eval()
    x = prompt(2, 11)
    h = base(x).last_hidden_state
    assert h.shape == (2, 11, 32)
    assert torch.equal(lm.model.head(h), lm(x).logits)


# --- Trainer ------------------------------------------------------------------------------------

def test_trainer_smoke_on_the_embedded_corpus(tmp_path, monkeypatch):
    from fastrpe.data.text import load_corpus

    monkeypatch.setenv("FASTRPE_CACHE", str(tmp_path / "cache"))
    stream = load_corpus(max_bytes=50_000).train
    windows = stream[: 32 * 65].view(32, 65)  # 32 windows of 65 bytes
    data = [{"input_ids": w, "labels": w} for w in windows]
    model = tiny("nprf", "kerple_log", std=0.02).train()
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=5, per_device_train_batch_size=4,
                             learning_rate=3e-3, logging_steps=1, report_to=[], save_strategy="no",
                             use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 5 and all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0]
    changed = [k for k, v in model.named_parameters() if not torch.equal(v.detach(), before[k])]
    assert "model.embed.weight" in changed and any(".attn.positions." in k for k in changed)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kernel,position,_", CASES, ids=IDS)
def test_generate_on_cuda_equals_fastrpe_generate(kernel, position, _, dtype):
    model = tiny(kernel, position).to("cuda", dtype)
    x = prompt(2, 7).cuda()
    assert torch.equal(model.generate(x, max_new_tokens=10, do_sample=False), model.model.generate(x, 10))


def test_docs_hf_models_example_runs():
    from pathlib import Path
    import re

    doc = Path(__file__).resolve().parents[1] / "docs" / "HF.md"
    code = re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S)[0]
    ns: dict = {}
    exec(compile(code, str(doc), "exec"), ns)  # noqa: S102 - our own docs
    assert ns["cache"] is getattr(ns["out"], CACHE)
    assert all(isinstance(s, LinearState) for s in getattr(ns["out"], CACHE).states)
