"""`fastrpe reproduce stability|conversion|speed` on tiny settings: each runs through the CLI
and writes standard JSON (no NaN/Infinity constants) with the fields RESULTS.md quotes.
approx, extrapolation and fastrpb have their own tests (test_cli.py, test_reproduce_*.py)."""
import json

import pytest

from fastrpe.cli.main import main
from fastrpe.cli.reproduce import finite_or_null
from fastrpe.reproduce import EXPERIMENTS

TINY_LM = ["--train-length", "8", "--batch-size", "4", "--d-model", "16", "--layers", "1", "--heads", "2",
           "--max-bytes", "100000", "--eval-tokens", "256"]


def _load(path):
    return json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))


def test_every_experiment_is_registered():
    assert {"approx", "speed", "stability", "conversion", "extrapolation", "fastrpb"} <= set(EXPERIMENTS)


def test_finite_or_null():
    assert finite_or_null({"a": [1.0, float("nan")], "b": (float("inf"), 2), "c": "x"}) == \
        {"a": [1.0, None], "b": [None, 2], "c": "x"}


def test_stability_tiny(tmp_path):
    rc = main(["reproduce", "stability", "--steps", "4", "--seeds", "2", "--configs", "PRF,NPRF + RPE",
               *TINY_LM, "--out", str(tmp_path)])
    assert rc == 0
    res = _load(tmp_path / "stability.json")
    assert res["experiment"] == "stability" and set(res["summary"]) == {"PRF", "NPRF + RPE"}
    assert len(res["runs"]) == 4 and {r["seed"] for r in res["runs"]} == {0, 1}
    for r in res["runs"]:
        assert r["status"] in ("ok", "stalled", "diverged")
        assert r["steps_run"] == 4 and len(r["curve"]) >= 2
    for s in res["summary"].values():
        assert s["runs"] == 2 and s["ok"] + s["stalled"] + s["diverged"] == 2
    assert res["unigram_val_loss"] > 0
    assert (tmp_path / "stability.png").exists()


def test_stability_refuses_unknown_config(tmp_path, capsys):
    assert main(["reproduce", "stability", "--configs", "PRF,nope", "--steps", "1", *TINY_LM,
                 "--out", str(tmp_path)]) == 2
    assert "unknown configuration" in capsys.readouterr().err


def test_conversion_tiny(tmp_path):
    rc = main(["reproduce", "conversion", "--steps", "4", "--features", "4,16", "--draws", "2", *TINY_LM,
               "--out", str(tmp_path)])
    assert rc == 0
    res = _load(tmp_path / "conversion.json")
    assert [r["model"] for r in res["rows"]] == ["softmax", "softmax + RPE", "normalized", "normalized + RPE"]
    for r in res["rows"]:
        assert r["softmax_val_loss"] > 0
        assert [p["features"] for p in r["prf"]] == [4, 16]
        assert all(len(p["val_loss_all"]) == 2 for p in r["prf"])
    assert (tmp_path / "conversion.png").exists()


def test_conversion_swaps_only_the_kernel():
    """normalize_qk + set_kernel: a normalized softmax model converted to PRF with many features
    scores close to itself (PRF estimates exactly its softmax kernel), and back to softmax exactly."""
    import torch

    from fastrpe.nn import DecoderLM, LMConfig
    from fastrpe.reproduce.conversion import normalize_qk, set_kernel

    torch.manual_seed(0)
    model = DecoderLM(LMConfig(vocab_size=50, d_model=16, n_layers=1, n_heads=2, kernel="softmax", position="none"))
    normalize_qk(model, temperature=2.0)
    x = torch.randint(0, 50, (2, 12))
    with torch.no_grad():
        ref = model.loss(x).item()
        set_kernel(model, __import__("fastrpe").kernels.PRF(8, 4096, seed=0))
        prf = model.loss(x).item()
        set_kernel(model, "softmax")
        back = model.loss(x).item()
    assert back == ref
    assert abs(prf - ref) < 0.05 * ref


def test_conversion_normalization_is_the_papers():
    """Luo et al. §3.2 and footnote 5: unit q and k, logits q̂·k̂ in [−1, 1], nothing learned."""
    import torch

    from fastrpe.nn import DecoderLM, LMConfig
    from fastrpe.reproduce.conversion import normalize_qk

    torch.manual_seed(0)
    model = DecoderLM(LMConfig(vocab_size=50, d_model=16, n_layers=1, n_heads=2, kernel="softmax", position="none"))
    before = sum(p.numel() for p in model.parameters())
    normalize_qk(model)
    assert sum(p.numel() for p in model.parameters()) == before
    layer = model.blocks[0].attn
    seen = {}
    inner = layer._attend.__defaults__[0]

    def spy(q, k, v, q_offset, kpm):
        seen["logits"] = (q @ k.transpose(-1, -2)) * layer.head_dim ** -0.5
        return inner(q, k, v, q_offset, kpm)

    layer._attend = lambda q, k, v, qo, kpm, _f=layer._attend: _f(q, k, v, qo, kpm, _inner=spy)
    with torch.no_grad():
        model.loss(torch.randint(0, 50, (2, 12)))
    assert seen["logits"].abs().max() <= 1 + 1e-6
    assert seen["logits"].abs().max() > 0.5  # not flattened either


def test_speed_tiny(tmp_path):
    rc = main(["reproduce", "speed", "--lengths", "32,64", "--heads", "1", "--dim", "8", "--features", "8",
               "--repeats", "1", "--positions", "kerple_log,alibi", "--out", str(tmp_path),
               "--competitors", "nprf fft,nprf soe,nprf chunked,softmax dense + RPE"])
    assert rc == 0
    res = _load(tmp_path / "speed.json")
    assert res["lengths"] == [32, 64] and res["device"]
    ran = {(r["competitor"], r["problem"]["position"]) for r in res["rows"] if "seconds" in r}
    # exact kernelized RPE by FFT everywhere; the linear-time forms where they apply
    assert {("nprf fft", "kerple_log"), ("nprf soe", "kerple_log"), ("nprf chunked", "alibi"),
            ("softmax dense + RPE", "alibi")} <= ran
    assert ("nprf chunked", "kerple_log") not in ran  # refused, with its reason
    assert {r["competitor"] for r in res["rows"]} == {"nprf fft", "nprf soe", "nprf chunked", "softmax dense + RPE"}
    for r in res["rows"]:
        assert ("seconds" in r and r["seconds"] > 0) or r.get("skipped") or r.get("error")
    assert all(s["time"] is not None for s in res["slopes"].values())
    assert (tmp_path / "speed.png").exists()


def test_speed_refuses_unknown_competitor(tmp_path, capsys):
    assert main(["reproduce", "speed", "--lengths", "32", "--competitors", "nope", "--out", str(tmp_path)]) == 2
    assert "unknown competitor" in capsys.readouterr().err


def test_the_one_window_sampler_reaches_every_start():
    """`data.text.random_windows` (used by `fastrpe train`'s LM task, the main job and the LM
    reproductions): windows of L + 1 tokens start anywhere in 0 .. len - L - 1, the last too."""
    import torch

    from fastrpe.data.text import random_windows

    w = random_windows(torch.arange(10), 4, 500, torch.Generator().manual_seed(0))
    assert w.shape == (500, 5) and bool((w[:, 1:] - w[:, :-1] == 1).all())
    assert set(w[:, 0].tolist()) == set(range(6))
    with pytest.raises(ValueError, match="too short"):
        random_windows(torch.arange(4), 4, 1, torch.Generator())
