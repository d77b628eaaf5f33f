"""Every command-line entry point prints its --help (argparse formats every help string, so a stray % fails)."""
import subprocess
import sys

SCRIPTS = [
    "pretrain_gpt.py", "tasks/main.py", "tools/generate_samples_gpt.py", "tools/run_text_generation_server.py",
    "tools/text_generation_cli.py", "tools/preprocess_data.py", "tools/preprocess_data_many_cores.py",
    "tools/merge_preprocessed_data.py", "tools/train_bpe_tokenizer.py", "tools/convert_deepspeed_checkpoint.py",
]


def test_help_of_every_entry_point(repo_root):
    procs = {s: subprocess.Popen([sys.executable, str(repo_root / s), "--help"], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for s in SCRIPTS}
    for script, proc in procs.items():
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, f"{script} --help failed:\n{err[-2000:]}"
        assert "usage:" in out, script
