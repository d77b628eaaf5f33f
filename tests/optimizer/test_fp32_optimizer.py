"""Param groups and the fp32 optimizer against plain torch AdamW/SGD."""
import pytest
import torch

from megatron.optimizer import FP32Optimizer, OptimizerConfig, get_megatron_optimizer, get_param_groups
from megatron.optimizer.optimizer_config import optimizer_config_from_args
from tests.optimizer.helpers import batches, clone, loss_fn, params, tiny_model


def test_param_groups_split_weight_decay():
    model = tiny_model()
    groups = get_param_groups([model])
    assert [g["wd_mult"] for g in groups] == [1.0, 0.0]
    assert all(g["lr_mult"] == 1.0 for g in groups)
    wd_ids = {id(p) for p in groups[0]["params"]}
    # only the two Linear weights decay; biases and LayerNorm weight/bias (1-D) do not
    assert wd_ids == {id(model[0].weight), id(model[3].weight)}
    assert len(groups[1]["params"]) == 4


def test_param_groups_lr_mult_and_conditions():
    model = tiny_model()
    model[1].weight.requires_grad_(False)
    groups = get_param_groups(
        model, no_weight_decay_cond=lambda n, p: n.startswith("0."), scale_lr_cond=lambda n, p: n.startswith("3."),
        lr_mult=0.1,
    )
    summary = [(g["wd_mult"], g["lr_mult"], len(g["params"])) for g in groups]
    # (wd,lr): LN bias; (wd,scaled): layer 3 w+b; (no wd,lr): layer 0 w+b
    assert summary == [(1.0, 1.0, 1), (1.0, 0.1, 2), (0.0, 1.0, 2)]


def _reference_groups(model, wd):
    groups = get_param_groups(model)
    return [{"params": g["params"], "weight_decay": wd * g["wd_mult"]} for g in groups]


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_adam_matches_torch_adamw(clip):
    model, ref = tiny_model(), tiny_model()
    cfg = OptimizerConfig(lr=1e-2, weight_decay=0.1, adam_beta1=0.8, adam_beta2=0.95, adam_eps=1e-6, clip_grad=clip)
    opt = get_megatron_optimizer([model], cfg)
    assert isinstance(opt, FP32Optimizer)
    ref_opt = torch.optim.AdamW(_reference_groups(ref, 0.1), lr=1e-2, betas=(0.8, 0.95), eps=1e-6, fused=True)
    for x, y in batches(4):
        opt.zero_grad()
        loss_fn(model, x, y).backward()
        ok, norm, zeros = opt.step()
        ref_opt.zero_grad()
        loss_fn(ref, x, y).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip) if clip else None
        ref_opt.step()
        assert ok and zeros is None
        if clip:
            assert norm == pytest.approx(float(ref_norm), rel=1e-6)
        else:
            assert norm is None
    for a, b in zip(model.parameters(), ref.parameters()):
        if clip:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(a, b)


def test_sgd_matches_torch():
    model, ref = tiny_model(), tiny_model()
    opt = get_megatron_optimizer(model, OptimizerConfig(optimizer="sgd", lr=0.1, weight_decay=0.01, clip_grad=0.0,
                                                        sgd_momentum=0.5, log_num_zeros_in_grad=True))
    ref_opt = torch.optim.SGD(_reference_groups(ref, 0.01), lr=0.1, momentum=0.5)
    for x, y in batches(3):
        opt.zero_grad()
        loss_fn(model, x, y).backward()
        _, _, zeros = opt.step()
        assert zeros == 0
        ref_opt.zero_grad()
        loss_fn(ref, x, y).backward()
        ref_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))


def test_fp32_state_dict_round_trip_bit_exact(tmp_path):
    data = batches(6)
    cfg = OptimizerConfig(lr=1e-2, clip_grad=1.0)
    model = tiny_model()
    opt = get_megatron_optimizer(model, cfg)
    for i, (x, y) in enumerate(data):
        if i == 3:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
        opt.zero_grad()
        loss_fn(model, x, y).backward()
        opt.step()
    resumed = tiny_model(seed=5)
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    resumed.load_state_dict(ckpt["model"])
    opt2 = get_megatron_optimizer(resumed, cfg)
    opt2.load_state_dict(ckpt["opt"])
    for x, y in data[3:]:
        opt2.zero_grad()
        loss_fn(resumed, x, y).backward()
        opt2.step()
    assert all(torch.equal(a, b) for a, b in zip(params(model), params(resumed)))


def test_count_zeros_and_loss_scale():
    model = tiny_model()
    opt = get_megatron_optimizer(model, OptimizerConfig(clip_grad=0.0, log_num_zeros_in_grad=True))
    assert opt.get_loss_scale().item() == 1.0
    x, y = batches(1)[0]
    loss = loss_fn(model, x, y)
    assert torch.equal(opt.scale_loss(loss), loss)
    loss.backward()
    model[3].weight.grad[0].zero_()
    _, _, zeros = opt.step()
    assert zeros == 8


def test_config_errors_and_from_args():
    with pytest.raises(ValueError, match="--optimizer"):
        OptimizerConfig(optimizer="lamb")
    with pytest.raises(ValueError, match="mutually exclusive"):
        OptimizerConfig(fp16=True, bf16=True)
    with pytest.raises(ValueError, match="--use-distributed-optimizer needs every model chunk wrapped in the local DDP"):
        get_megatron_optimizer(tiny_model(), OptimizerConfig(use_distributed_optimizer=True))

    class Args:
        optimizer, lr, weight_decay, fp16, bf16, loss_scale, clip_grad = "sgd", 3e-4, 0.0, True, False, None, 0.5

    cfg = optimizer_config_from_args(Args())
    assert (cfg.optimizer, cfg.lr, cfg.weight_decay, cfg.clip_grad) == ("sgd", 3e-4, 0.0, 0.5)
    assert cfg.params_dtype == torch.half and cfg.loss_scale is None and cfg.hysteresis == 2
    assert clone(tiny_model()) is not None


def test_load_errors_and_apex_layout():
    model = tiny_model()
    opt = get_megatron_optimizer(model, OptimizerConfig(lr=1e-2))
    for x, y in batches(2):
        opt.zero_grad()
        loss_fn(model, x, y).backward()
        opt.step()
    sd = torch.load(_roundtrip(opt.state_dict()), weights_only=False)
    # apex FusedAdam keeps 'step' per group, not per param (Megatron checkpoints)
    for group in sd["param_groups"]:
        group["step"] = 2
        for index in group["params"]:
            del sd["state"][index]["step"]
    fresh = get_megatron_optimizer(tiny_model(), OptimizerConfig(lr=1e-2))
    fresh.load_state_dict(sd)
    assert all(float(st["step"]) == 2.0 for st in fresh.optimizer.state.values())
    other = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 3))
    with pytest.raises(ValueError, match="--no-load-optim"):
        get_megatron_optimizer(other, OptimizerConfig()).load_state_dict(opt.state_dict())
    with pytest.raises(ValueError, match="--no-load-optim"):
        fresh.load_state_dict({"optimizer": {}, "fp32_from_fp16_params": []})


def test_step_records_megatron_timers():
    names = []

    class Timer:
        def __init__(self, name):
            self.name = name

        def start(self, barrier=False):
            names.append(self.name)

        def stop(self, barrier=False):
            pass

    model = tiny_model()
    opt = get_megatron_optimizer(model, OptimizerConfig(log_num_zeros_in_grad=True))
    loss_fn(model, *batches(1)[0]).backward()
    opt.step(timers=lambda name, log_level=None: Timer(name))
    assert names == ["optimizer-clip-main-grad", "optimizer-count-zeros", "optimizer-inner-step"]


def _roundtrip(obj):
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf
