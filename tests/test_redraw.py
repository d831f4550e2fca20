"""Performer-style redrawing of random feature projections during training: every map
redraws every N steps, deterministically from the run's seed, the map's name and the step;
the projections are buffers saved in checkpoints, so a resumed run is bit-identical."""
from __future__ import annotations

import pytest
import torch

import fastrpe as fr
from fastrpe.nn import DecoderLM, LMConfig
from fastrpe.train import TrainConfig, seeded_batches, train
from fastrpe.train.redraw import random_feature_maps, redraw_seed

pytest.importorskip("safetensors")


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _model(feature_seed: int = 0):
    torch.manual_seed(0)
    return DecoderLM(LMConfig(vocab_size=11, d_model=16, n_layers=2, n_heads=2, kernel="prf", num_features=4,
                              position="none", feature_seed=feature_seed))


def _sample(g: torch.Generator, bs: int):
    return torch.randint(0, 11, (bs, 9), generator=g)


def _run(model, tmp, steps, **kw):
    # a constant schedule: a 3-step run is the first 3 steps of a 7-step one
    cfg = TrainConfig(steps=steps, batch_size=4, lr=1e-2, warmup_steps=0, schedule="constant", out_dir=str(tmp),
                      progress=False, log_every=1, feature_redraw_interval=2, **kw)
    return train(model, lambda m, x: m.loss(x), seeded_batches(_sample, 4, seed=0), cfg)


def _projections(model) -> dict[str, torch.Tensor]:
    return {n: m.w.clone() for n, m in random_feature_maps(model)}


def test_every_map_redraws_every_n_steps_and_only_then(tmp_path):
    model = _model()
    before = _projections(model)
    assert len(before) == 2
    seen = []
    cfg = TrainConfig(steps=5, batch_size=4, lr=1e-2, warmup_steps=0, progress=False, feature_redraw_interval=2)
    train(model, lambda m, x: m.loss(x), seeded_batches(_sample, 4, seed=0), cfg,
          callbacks=[lambda st: seen.append(_projections(st.model))])
    for step, w in enumerate(seen, start=1):
        prev = before if step == 1 else seen[step - 2]
        for name in w:
            assert torch.equal(w[name], prev[name]) == (step % 2 != 0), (step, name)
    # the draw at step 4 is the map's redraw from the documented seed
    ref = _model()
    for name, m in random_feature_maps(ref):
        m.redraw(redraw_seed(0, name, 4))
        assert torch.equal(m.w, seen[-1][name])
    a, b = seen[-1].values()
    assert not torch.equal(a, b)  # the layers' redraws differ too


def test_no_interval_never_redraws():
    model = _model()
    before = _projections(model)
    cfg = TrainConfig(steps=3, batch_size=4, lr=1e-2, warmup_steps=0, progress=False)
    train(model, lambda m, x: m.loss(x), seeded_batches(_sample, 4, seed=0), cfg)
    assert all(torch.equal(before[n], w) for n, w in _projections(model).items())


def test_checkpoint_restores_projections_and_a_resumed_run_redraws_identically(tmp_path):
    whole = _model()
    _run(whole, tmp_path / "whole", 7)
    part = _model()
    _run(part, tmp_path / "part", 3, ckpt_every=3)  # redraw at step 2; checkpoint at 3
    resumed = _model(feature_seed=5)  # other initial projections: they must come from the checkpoint
    assert not any(torch.equal(resumed_w, w) for resumed_w, w in zip(_projections(resumed).values(),
                                                                       _projections(part).values()))
    res = _run(resumed, tmp_path / "part", 7, resume=True)
    assert res.resumed_from == 3
    a, b = whole.state_dict(), resumed.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(k.endswith("kernel.w") for k in a)


def test_config_field_is_validated_and_round_trips():
    with pytest.raises(ValueError, match="feature_redraw_interval"):
        TrainConfig(feature_redraw_interval=-1)
    cfg = TrainConfig(feature_redraw_interval=100)
    assert TrainConfig.from_json(cfg.to_json()) == cfg
    assert fr.kernels.PRF  # the maps redraw through their own `redraw`


def test_cli_trains_scaleformers_model_with_redraws(tmp_path):
    """`fastrpe train --position shaw` with a random map; `--feature-redraw-interval` reaches the loop."""
    from fastrpe.cli.main import main

    out = tmp_path / "run"
    assert main(["train", "--task", "lm", "--kernel", "prf", "--position", "shaw", "--seq-len", "16",
                 "--max-bytes", "100000", "--batch-size", "4", "--steps", "4", "--eval-samples", "4",
                 "--feature-redraw-interval", "2", "--no-progress", "--out", str(out)]) == 0
    import json

    assert json.loads((out / "config.json").read_text())["feature_redraw_interval"] == 2
    assert json.loads((out / "task.json").read_text())["position"] == "shaw"


def test_unknown_model_position_lists_every_name():
    with pytest.raises(ValueError, match="unknown name 'nope'; known: none, sinusoidal, rotary, shaw, .*geometric"):
        DecoderLM(LMConfig(position="nope"))
