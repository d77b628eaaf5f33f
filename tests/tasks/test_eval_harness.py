"""lm-evaluation-harness adapter (tasks/eval_harness) against Hugging Face on the same weights, and under TP/DP/PP.

The model is the zero-shot tests' tiny GPT (5,000-token vocabulary padded to 5,120). The Hugging Face reference is
GPT2LMHeadModel built from the same weights with megatron/models/gpt/hf.py and cut to the real 5,000 rows, so
its softmax runs over the real vocabulary, as ours must. Only the shipped local tasks are used (no downloads).
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from megatron.inference import EngineConfig, InferenceEngine
from megatron.models.gpt.hf_gpt2 import hf_gpt2_config_kwargs, megatron_gpt_to_hf_state_dict
from megatron.models.gpt.model import GPTModel
from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer
from tests.dist_utils import run_distributed
from tests.tasks import helpers as H

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
lm_eval = pytest.importorskip("lm_eval")
transformers = pytest.importorskip("transformers")

from tasks.eval_harness.adapter import MegatronLM  # noqa: E402
from tasks.eval_harness.evaluate import task_manager  # noqa: E402

LOCAL_TASKS = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "tasks", "eval_harness", "local_tasks")
TASKS = ["lambada_local", "wikitext_local", "mc_local", "qa_gen_local"]
LIMIT = 4
REAL_VOCAB = 5000


class Req:
    """The part of lm-eval's Instance the adapter reads."""

    def __init__(self, *args):
        self.args = args


# ----------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def setup(shared_data, tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("eval_harness")
    flat = H.random_state_dict(seed=0)
    owt = shared_data / "openwebtext-1000"
    vocab, merges = str(owt / "gpt2-tiny-vocab.json"), str(owt / "gpt2-tiny-merges.txt")
    model = GPTModel(H.tiny_config()).eval()
    model.load_state_dict(flat)
    config = H.tiny_config()
    hf_config = transformers.GPT2Config(**{**hf_gpt2_config_kwargs(config), "vocab_size": REAL_VOCAB},
                                        bos_token_id=REAL_VOCAB - 1, eos_token_id=REAL_VOCAB - 1)
    hf = transformers.GPT2LMHeadModel(hf_config).eval()
    sd = megatron_gpt_to_hf_state_dict(flat, config)
    sd = {k: v[:REAL_VOCAB] if k in ("transformer.wte.weight", "lm_head.weight") else v for k, v in sd.items()}
    hf.load_state_dict(sd, strict=False)
    hf_tok = transformers.GPT2TokenizerFast(vocab=vocab, merges=merges, eos_token="<|endoftext|>",
                                            bos_token="<|endoftext|>", unk_token="<|endoftext|>")
    return {"dir": d, "flat": flat, "model": model, "tok": GPT2BPETokenizer(vocab, merges), "hf": hf,
            "hf_tok": hf_tok, "vocab": vocab, "merges": merges, "ckpt1": H.save_megatron_checkpoint(flat, d / "tp1"),
            "ckpt2": H.save_megatron_checkpoint(flat, d / "tp2", tp=2)}


def _lm(setup: dict, batch_size: int = 4, **kwargs) -> MegatronLM:
    return MegatronLM(setup["model"], setup["tok"], max_length=H.SEQ, batch_size=batch_size, progress=False,
                      **kwargs)


# ----------------------------------------------------------------------------------------------- HF references
def _hf_logp(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(input_ids=torch.tensor([ids])).logits[0].double(), -1)


def hf_loglikelihood(setup: dict, context: str, continuation: str) -> tuple[float, bool]:
    tok, eot, L = setup["hf_tok"], REAL_VOCAB - 1, H.SEQ
    if context == "":
        ctx, cont = [eot], tok.encode(continuation)
    else:
        n = len(context) - len(context.rstrip())  # trailing context spaces belong to the continuation
        context, continuation = (context[:-n], context[-n:] + continuation) if n else (context, continuation)
        whole, ctx = tok.encode(context + continuation), tok.encode(context)
        cont = whole[len(ctx):]
    full = (ctx + cont)[-(L + 1):]
    logp = _hf_logp(setup["hf"], full[:-1])[-len(cont):]
    target = torch.tensor(cont)
    return float(logp.gather(1, target[:, None]).sum()), bool((logp.argmax(-1) == target).all())


def hf_rolling(setup: dict, text: str) -> float:
    """Every token scored once; block k predicts tokens [kL, kL+L) from the L tokens (EOT first) before its end."""
    toks, L = setup["hf_tok"].encode(text), H.SEQ
    full, total = [REAL_VOCAB - 1] + toks, 0.0
    for a in range(0, len(toks), L):
        b = min(a + L, len(toks))
        start = max(0, b - L)
        logp = _hf_logp(setup["hf"], full[start:b])
        for j in range(a, b):
            total += float(logp[j - start, toks[j]])
    return total


def hf_greedy(setup: dict, context: str, max_gen: int, until: list[str]) -> str:
    tok, eot = setup["hf_tok"], REAL_VOCAB - 1
    ids = tok.encode(context)[-(H.SEQ - max_gen):]
    new: list[int] = []
    for _ in range(max_gen):
        nxt = int(_hf_logp(setup["hf"], ids + new)[-1].argmax())
        if nxt == eot:
            break
        new.append(nxt)
    text = tok.decode(new)
    for stop in until:
        text = text.split(stop)[0]
    return text


# ----------------------------------------------------------------------------------------------- tests
def test_tokenizers_agree(setup):
    texts = [json.loads(line)["text"] for line in open(os.path.join(LOCAL_TASKS, "data", "lambada_sample.jsonl"))]
    for text in texts[:LIMIT] + ["Question: What is the capital of France?\nAnswer:"]:
        assert setup["tok"].tokenize(text) == setup["hf_tok"].encode(text)


def test_loglikelihood_equals_hf(setup):
    pairs = [("", " The cat"),  # empty context: EOT
             ("The cat sat on the", " mat"),
             ("She opened the door and said ", "hello there"),  # trailing space moves to the continuation
             (" ".join(["word"] * 90), " and more words"),  # longer than the model: left-truncated
             ("A", "B"),
             ("The cat sat on the", " dog"), ("A", "B")]  # one-token choices / repeats share a forward row
    ours = _lm(setup, batch_size=2).loglikelihood([Req(c, x) for c, x in pairs])
    for (ctx, cont), (lp, greedy) in zip(pairs, ours):
        ref_lp, ref_greedy = hf_loglikelihood(setup, ctx, cont)
        assert lp == pytest.approx(ref_lp, abs=1e-4), (ctx[:20], cont)
        assert greedy == ref_greedy
    # batching and padding to --seq-length (no --adaptive_seq_len) change nothing
    padded = _lm(setup, batch_size=5, adaptive_seq_len=False).loglikelihood([Req(c, x) for c, x in pairs])
    for a, b in zip(ours, padded):
        assert a[0] == pytest.approx(b[0], abs=1e-5) and a[1] == b[1]


def test_greedy_flag_and_padded_vocab(setup):
    lm = _lm(setup)
    # the argmax continuation is greedy by definition
    ctx = "The cat sat on the"
    nxt = int(_hf_logp(setup["hf"], setup["hf_tok"].encode(ctx))[-1].argmax())
    (lp, greedy), = lm.loglikelihood([Req(ctx, setup["tok"].detokenize([nxt]))])
    assert greedy and lp < 0
    # make a padded vocabulary row (id >= 5000) the model's favourite: it must change nothing
    model = GPTModel(H.tiny_config()).eval()
    flat = {k: v.clone() for k, v in setup["flat"].items()}
    emb = flat["language_model.embedding.word_embeddings.weight"]
    emb[REAL_VOCAB + 7] = 50 * emb[:REAL_VOCAB].mean(0) + 10  # huge logit for a padding row
    model.load_state_dict(flat)
    boosted = MegatronLM(model, setup["tok"], max_length=H.SEQ, progress=False)
    ids = torch.tensor([setup["tok"].tokenize(ctx)])
    with torch.no_grad():
        n = ids.size(1)
        full = model(ids, torch.arange(n)[None], torch.ones(1, 1, n, n, dtype=torch.bool).triu(1))[0, -1]
    assert int(full.argmax()) >= REAL_VOCAB  # the padding row would win an unrestricted argmax
    (lp2, greedy2), = boosted.loglikelihood([Req(ctx, setup["tok"].detokenize([nxt]))])
    assert greedy2 and lp2 == pytest.approx(lp, abs=1e-5)


def test_rolling_equals_hf(setup):
    texts = ["Short text.", " ".join(f"token{i}" for i in range(70)),  # several windows
             open(os.path.join(LOCAL_TASKS, "data", "wikitext_sample.jsonl")).readline()[:600]]
    ours = _lm(setup, batch_size=3).loglikelihood_rolling([Req(t) for t in texts])
    for text, value in zip(texts, ours):
        assert value == pytest.approx(hf_rolling(setup, text), abs=1e-4)


def test_generate_until_equals_hf_greedy(setup):
    cases = [("Question: What is the capital of France?\nAnswer:", {"until": ["\n"], "max_gen_toks": 12,
                                                                     "do_sample": False}),
             ("The history of the city", {"until": "."}),  # a string `until` and the default max_gen_toks
             ("Once upon a time", {"until": ["\n", " the"], "max_gen_toks": 20, "temperature": 0.0})]
    ours = _lm(setup, max_gen_toks=16).generate_until([Req(c, k) for c, k in cases])
    for (ctx, kw), text in zip(cases, ours):
        until = kw["until"] if isinstance(kw["until"], list) else [kw["until"]]
        assert text == hf_greedy(setup, ctx, kw.get("max_gen_toks", 16), until)
        assert not any(u in text for u in until)
    engine = InferenceEngine(setup["model"], EngineConfig(num_blocks=32, block_size=16), eod=int(setup["tok"].eod))
    assert _lm(setup, max_gen_toks=16, engine=engine).generate_until([Req(c, k) for c, k in cases]) == ours
    sampled = [("Once upon a time", {"until": ["\n"], "max_gen_toks": 10, "do_sample": True, "temperature": 1.0,
                                     "top_k": 50})] * 2
    a = _lm(setup).generate_until([Req(*s) for s in sampled])
    b = _lm(setup).generate_until([Req(*s) for s in sampled])
    assert a == b and all("\n" not in t for t in a)  # seeded: reproducible
    with pytest.raises(ValueError, match="num_beams"):
        _lm(setup).generate_until([Req("x", {"until": ["\n"], "num_beams": 4})])


def _metrics(results: dict) -> dict:
    out = {}
    for task, values in results["results"].items():
        for key, value in values.items():
            if isinstance(value, (int, float)) and not key.endswith("_stderr,none") and key != "alias":
                out[(task, key)] = value
    return out


@pytest.mark.slow  # lm-eval starts `git` processes
def test_simple_evaluate_equals_lm_eval_hf_backend(setup):
    from lm_eval.models.huggingface import HFLM

    manager = task_manager(LOCAL_TASKS, TASKS)
    kw = dict(tasks=TASKS, limit=LIMIT, bootstrap_iters=0, task_manager=manager, log_samples=True)
    ours_out = lm_eval.simple_evaluate(model=_lm(setup, max_gen_toks=8), **kw)
    ref_lm = HFLM(pretrained=setup["hf"], tokenizer=setup["hf_tok"], batch_size=1, device="cpu", max_length=H.SEQ)
    ref_out = lm_eval.simple_evaluate(model=ref_lm, **kw)
    ours, ref = _metrics(ours_out), _metrics(ref_out)
    # per document: the generated answers are the same strings, the log-likelihoods the same numbers
    for a, b in zip(ours_out["samples"]["qa_gen_local"], ref_out["samples"]["qa_gen_local"]):
        assert a["resps"] == b["resps"] and a["resps"][0][0]
    for task in ("lambada_local", "mc_local"):
        for a, b in zip(ours_out["samples"][task], ref_out["samples"][task]):
            got = [r[0] for r in a["resps"]]
            want = [r[0] for r in b["resps"]]
            assert [g for _, g in got] == [g for _, g in want]
            assert [lp for lp, _ in got] == pytest.approx([lp for lp, _ in want], abs=1e-4, rel=3e-5)  # HFLM: fp32 log-softmax
    assert set(ours) == set(ref) and len(ours) >= 9, sorted(ref)
    for key, value in ref.items():
        if key[1].startswith(("acc", "exact_match")):
            assert ours[key] == value, key
        else:
            assert ours[key] == pytest.approx(value, rel=1e-4), key
    setup["tp1_metrics"] = ours


# ----------------------------------------------------------------------------------------------- entry point, TP/DP/PP
def _argv(setup: dict, shared_data, ckpt, out, tp: int = 1, pp: int = 1, extra: tuple = ()) -> list[str]:
    return (["--task_list", ",".join(TASKS), "--include_path", LOCAL_TASKS, "--limit", str(LIMIT),
             "--results_path", str(out), "--bootstrap_iters", "0", "--micro-batch-size", "2", "--adaptive_seq_len",
             "--max_gen_toks", "8", "--pipeline-model-parallel-size", str(pp)]
            + H.model_flags(shared_data, ckpt, tp) + list(extra))


def _run_main(argv: list[str]) -> dict:
    from megatron.initialize import destroy_megatron
    from tasks.eval_harness.evaluate import main

    try:
        return main(argv)
    finally:
        destroy_megatron()


def _dist_body(rank: int, world_size: int, argv: list[str]) -> dict:
    os.environ["HF_DATASETS_OFFLINE"] = os.environ["HF_HUB_OFFLINE"] = "1"
    return _metrics(_run_main(argv))


@pytest.mark.slow  # lm-eval starts `git` processes
def test_entry_point_writes_lm_eval_json(setup, shared_data):
    """evaluate.py on the TP1 checkpoint; --bf16 --eval_fp32 must evaluate in fp32 (the in-process numbers), and
    --intermed_results (one task at a time) must give the same merged JSON."""
    out = setup["dir"] / "results.json"
    res = _run_main(_argv(setup, shared_data, setup["ckpt1"], out, extra=("--bf16", "--eval_fp32",
                                                                          "--intermed_results")))
    written = json.loads(out.read_text())
    assert set(written["results"]) == set(TASKS)
    assert {"configs", "versions", "n-shot", "n-samples", "higher_is_better"} <= set(written)
    tp1 = _metrics(res)
    assert _metrics(written) == tp1
    if "tp1_metrics" in setup:  # the checkpoint path gives the in-process numbers
        for key, value in setup["tp1_metrics"].items():
            assert tp1[key] == pytest.approx(value, rel=1e-5), key
    setup["main_metrics"] = tp1


@pytest.mark.parametrize("layout", ["tp2_dp2", "pp2"])
def test_parallel_layouts_equal_single_process(setup, shared_data, layout):
    if "main_metrics" not in setup:
        setup["main_metrics"] = _metrics(_run_main(_argv(setup, shared_data, setup["ckpt1"],
                                                         setup["dir"] / "ref.json")))
    if layout == "tp2_dp2":
        world, argv = 4, _argv(setup, shared_data, setup["ckpt2"], setup["dir"] / "tp2dp2.json", tp=2)
    else:
        from tests.tasks.test_eval_pp import save_pp_checkpoint

        ckpt = save_pp_checkpoint(setup["flat"], setup["dir"] / "pp2", 2)
        world, argv = 2, _argv(setup, shared_data, ckpt, setup["dir"] / "pp2.json", pp=2)
    for metrics in run_distributed(_dist_body, world_size=world, args=(argv,)):
        assert set(metrics) == set(setup["main_metrics"])
        for key, value in setup["main_metrics"].items():
            assert metrics[key] == pytest.approx(value, rel=1e-5), (layout, key)


@pytest.mark.slow  # starts the entry script
def test_help_missing_lm_eval_and_unknown_task(setup, shared_data, repo_root, monkeypatch):
    import subprocess
    import sys

    from tasks.eval_harness import LmEvalMissing, require_lm_eval

    env = {**os.environ, "PYTHONPATH": str(repo_root), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    script = str(repo_root / "tasks" / "eval_harness" / "evaluate.py")
    proc = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and "--task_list" in proc.stdout and "--include_path" in proc.stdout
    argv = [a if a != ",".join(TASKS) else "lambada_local,no_such_task"
            for a in _argv(setup, shared_data, setup["ckpt1"], setup["dir"] / "x.json")]
    proc = subprocess.run([sys.executable, script, *argv], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("error: unknown lm-eval task(s) no_such_task")
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if not installed
    with pytest.raises(LmEvalMissing, match=r'pip install "lm-eval>=0.4,<0.5"'):
        require_lm_eval()


def test_task_manager_indexes_only_the_local_folder_when_it_holds_every_task():
    manager = task_manager(LOCAL_TASKS, TASKS)  # lm-eval's own ~14,700 task files are not indexed (~14 s)
    assert set(TASKS) <= set(manager.all_tasks) and len(manager.all_tasks) < 50
