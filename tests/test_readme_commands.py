"""The README's command blocks run as written from the clone root after the quick-start.

The test makes a stand-in clone root (links to the repository's top-level entries), runs a short quick-start there,
then runs the README's short blocks exactly as written (preprocess, pretrain, generate + evaluate) and checks their
outputs. The long blocks (the BERT leg + T5, the server + lm-eval) are named here; for them, every repository path
they use must exist after the quick-start (the lm-eval command's model_args are run against a server by
tests/text_generation/test_openai_api.py). The docs/ pages' blocks are held to the same path rule."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.log_lines import iteration_lines

REPO = Path(__file__).resolve().parents[1]
SHORT = ("python tools/preprocess_data.py", "DATA_PATH=quickstart_out/data/python_docs_text_document", "MODEL=")
LONG = ("bash examples/quickstart.sh bert", "python tools/checkpoint/convert.py --model-type GPT --saver hf")
QUICKSTART = {"TRAIN_ITERS": "4", "LOG_INTERVAL": "2", "EVAL_INTERVAL": "4", "WIKI_LINES": "10", "LAMBADA_LINES": "10"}
# what the quick-start (and the BERT and chat legs) leave in quickstart_out/, and what the README's own blocks write there
PRODUCED = re.compile(r"^quickstart_out/(tokenizer|data|checkpoints|prompts\.txt|bert_tokenizer|bert_data|"
                      r"bert_checkpoints|hf|gpt_example|t5_example|more_samples|copy|owt|all|my-|ckpt_|mnli_pred|out|llama_|"
                      r"results|gpt_345m|bloom_|mixtral_example|cp_example|chat_)|^runs/ds_single_node/")


OUTPUTS = (r"(--save|--save-dir|--output-prefix|--output-folder|--sample-output-file|--tensorboard-dir|--results_path"
           r"|CHECKPOINT_PATH=|--output-dir)[ =]\S+")


def bash_blocks(page: Path) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S)


def paths_in(block: str) -> list[str]:
    """Relative file paths a block names (words with a slash and no shell or URL syntax)."""
    text = re.sub(r"'[^']*'", "", re.sub(r"#[^\n]*", "", block))  # comments; single-quoted headers and JSON
    text = re.sub(OUTPUTS, "", text)  # what a command writes need not exist before it
    words = re.findall(r"(?:^|[\s=,])((?:[\w.-]+/)+[\w.-]+)", text)
    return [w for w in words if not w.startswith(("http", "localhost", "/")) and "{" not in w]


def test_every_readme_block_is_classified_and_names_existing_paths() -> None:
    blocks = bash_blocks(REPO / "README.md")[2:]  # after the two commands and the install block
    assert blocks and all(b.startswith(SHORT + LONG) for b in blocks), [b[:60] for b in blocks]
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for block in bash_blocks(page):
            for path in paths_in(block):
                assert (REPO / path).exists() or PRODUCED.match(path) or path.startswith("data/glue_data"), \
                    f"{page.name}: {path} is neither shipped nor made by the quick-start or an earlier block"


def test_a_block_that_runs_lm_eval_installs_it_first() -> None:
    """The quick-start does not install lm-eval: a README block calling `lm_eval` installs the pinned version of
    requirements-dev.txt before it."""
    pinned = next(line.split("#")[0].strip() for line in (REPO / "requirements-dev.txt").read_text().splitlines()
                  if line.startswith("lm-eval"))
    blocks = [b for b in bash_blocks(REPO / "README.md") if re.search(r"^lm_eval ", b, flags=re.M)]
    assert blocks
    for block in blocks:
        install = block.find(f'pip install "{pinned}"')
        assert 0 <= install < re.search(r"^lm_eval ", block, flags=re.M).start(), block[:80]


@pytest.mark.slow
def test_readme_short_blocks_run_as_written_after_the_quickstart(tmp_path: Path) -> None:
    root = tmp_path / "clone"
    root.mkdir()
    for entry in REPO.iterdir():
        if entry.name not in (".git", "quickstart_out") and not entry.name.startswith("."):
            (root / entry.name).symlink_to(entry)
    env = dict(os.environ, SKIP_INSTALL="1", OMP_NUM_THREADS="1", **QUICKSTART)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")

    def run(command: str) -> str:
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=root, env=env, capture_output=True,
                              text=True, timeout=900)
        assert proc.returncode == 0, f"{command[:200]}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        return proc.stdout

    out = run("bash examples/quickstart.sh")
    results = out[out.index("== 6/6 zero-shot evaluation"):]
    assert "adjusted ppl" in results and "note: these evaluation numbers are expected" in results, results[-2000:]
    blocks = [b for b in bash_blocks(REPO / "README.md")[2:] if b.startswith(SHORT)]
    assert len(blocks) == 3
    for var in QUICKSTART:  # the README's blocks run with the user's environment, not the quick-start's settings
        env.pop(var)
    run(blocks[0])
    assert (root / "quickstart_out" / "data" / "copy_text_document.idx").is_file()
    out = run(blocks[1])
    assert re.search(r"^ > first iteration done in [0-9.]+ s \(iteration 1 of 20;", out, flags=re.M), out[-2000:]
    assert [it for it, _ in iteration_lines(out)] == [5, 10, 15, 20], out[-2000:]  # the tiny preset logs every 25
    tracker = root / "quickstart_out" / "gpt_example" / "latest_checkpointed_iteration.txt"
    assert tracker.read_text().strip() == "20"
    out = run(blocks[2])
    assert len((root / "quickstart_out" / "more_samples.jsonl").read_text().splitlines()) == 3
    assert re.search(r"number correct: +[0-9.E+-]+ \| total examples: +5\.0+E\+02", out), out[-2000:]
