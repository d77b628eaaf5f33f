"""OptimizerParamScheduler: lr/wd at key steps for each style vs closed forms, multipliers, checkpoint semantics."""
import math

import pytest
import torch

from megatron.learning_rates import OptimizerParamScheduler


def _opt():
    p1, p2 = torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))
    return torch.optim.SGD(
        [{"params": [p1], "wd_mult": 1.0, "lr_mult": 1.0}, {"params": [p2], "wd_mult": 0.0, "lr_mult": 0.5}], lr=1.0
    )


def _sched(style, warmup=100, decay=1000, max_lr=1e-3, min_lr=1e-5, init_lr=0.0, **kw):
    args = dict(start_wd=0.1, end_wd=0.1, wd_incr_steps=decay, wd_incr_style="constant")
    args.update(kw)
    return OptimizerParamScheduler(_opt(), init_lr, max_lr, min_lr, warmup, decay, style, **args)


def _lr_at(s, step):
    s.num_steps = 0
    s.step(step)
    return s.optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize("style", ["linear", "cosine", "constant", "inverse-square-root"])
def test_warmup_is_linear(style):
    s = _sched(style)
    assert s.optimizer.param_groups[0]["lr"] == 0.0  # step(0) in the constructor
    for step in (0, 1, 50, 100):
        assert _lr_at(s, step) == pytest.approx(1e-3 * step / 100, rel=1e-12, abs=0)


def test_linear_decay():
    s = _sched("linear")
    for step in (101, 300, 550, 999, 1000):
        assert _lr_at(s, step) == pytest.approx(1e-5 + (1e-3 - 1e-5) * (1 - (step - 100) / 900), rel=1e-12)
    assert _lr_at(s, 1001) == 1e-5
    assert _lr_at(s, 10**6) == 1e-5


def test_cosine_decay():
    s = _sched("cosine")
    for step in (101, 325, 550, 775, 1000):
        ratio = (step - 100) / 900
        assert _lr_at(s, step) == pytest.approx(1e-5 + (1e-3 - 1e-5) * 0.5 * (math.cos(math.pi * ratio) + 1), rel=1e-12)
    assert _lr_at(s, 550) == pytest.approx((1e-3 + 1e-5) / 2, rel=1e-12)
    assert _lr_at(s, 2000) == 1e-5


def test_constant_and_inverse_sqrt():
    s = _sched("constant")
    assert _lr_at(s, 500) == 1e-3 and _lr_at(s, 5000) == 1e-3
    s = _sched("inverse-square-root")
    for step in (101, 400, 900):
        assert _lr_at(s, step) == pytest.approx(max(1e-5, 1e-3 * math.sqrt(100) / math.sqrt(step)), rel=1e-12)
    assert _lr_at(s, 1001) == 1e-5


def test_no_warmup_and_init_lr():
    s = _sched("linear", warmup=0)
    assert _lr_at(s, 0) == pytest.approx(1e-3)
    s = _sched("linear", init_lr=1e-4)
    assert _lr_at(s, 50) == pytest.approx(1e-4 + (1e-3 - 1e-4) * 0.5)


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_weight_decay_increment(style):
    s = _sched("linear", start_wd=0.0, end_wd=0.1, wd_incr_steps=200, wd_incr_style=style)
    for step in (0, 50, 100, 200, 300):
        s.num_steps = 0
        s.step(step)
        ratio = min(step, 200) / 200
        coeff = ratio if style == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1)
        assert s.optimizer.param_groups[0]["weight_decay"] == pytest.approx(0.1 * coeff, abs=1e-15)
        assert s.optimizer.param_groups[1]["weight_decay"] == 0.0  # wd_mult 0


def test_multipliers():
    s = _sched("constant")
    s.step(500)
    g0, g1 = s.optimizer.param_groups
    assert g0["lr"] == 1e-3 and g1["lr"] == 0.5e-3
    assert g0["weight_decay"] == 0.1 and g1["weight_decay"] == 0.0


def test_state_dict_round_trip():
    s = _sched("cosine")
    for _ in range(7):
        s.step(64)
    sd = s.state_dict()
    t = _sched("cosine")
    t.load_state_dict(sd)
    assert t.num_steps == 448 and t.get_lr() == s.get_lr()
    assert t.optimizer.param_groups[0]["lr"] == s.optimizer.param_groups[0]["lr"]
    s.step(64)
    t.step(64)
    assert t.get_lr() == s.get_lr()


def test_checkpoint_semantics():
    sd = _sched("cosine", max_lr=2e-3).state_dict()
    sd["num_steps"] = 300
    # use-checkpoint (default): the checkpoint's values win.
    t = _sched("cosine")
    t.load_state_dict(sd)
    assert t.max_lr == 2e-3
    # override: the class values win.
    t = _sched("cosine", use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True)
    t.load_state_dict(sd)
    assert t.max_lr == 1e-3 and t.num_steps == 300
    # neither: values must match.
    t = _sched("cosine", use_checkpoint_opt_param_scheduler=False)
    with pytest.raises(ValueError, match="learning rate"):
        t.load_state_dict(sd)
    # Megatron's old key names.
    old = {"start_lr": 1e-3, "min_lr": 1e-5, "warmup_iter": 100, "end_iter": 1000, "decay_style": "linear",
           "num_iters": 550}
    t = _sched("linear")
    t.load_state_dict(old)
    assert t.get_lr() == pytest.approx(1e-5 + (1e-3 - 1e-5) * 0.5)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(warmup=1000, decay=1000), "warmup"),
        (dict(decay=0), "decay steps"),
        (dict(max_lr=1e-6, min_lr=1e-5), "--min-lr"),
        (dict(style="polynomial"), "--lr-decay-style"),
        (dict(start_wd=0.0, end_wd=0.1), "constant"),
        (dict(override_opt_param_scheduler=True), "both"),
    ],
)
def test_bad_config(kwargs, match):
    style = kwargs.pop("style", "linear")
    with pytest.raises(ValueError, match=match):
        _sched(style, **kwargs)
