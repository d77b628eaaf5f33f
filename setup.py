"""Install the `megatron` package and compile the dataset index helpers (csrc/helpers.cpp).

The C++ extension is optional at install time: if it cannot be compiled here, `megatron.data.helpers`
builds it on first use (rank 0) and tells you so.
"""
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent


def _ext_modules():
    try:
        from pybind11.setup_helpers import Pybind11Extension
    except ImportError:  # pybind11 missing at build time: build lazily at run time instead
        return []
    return [
        Pybind11Extension(
            "megatron.data.helpers_cpp",
            ["csrc/helpers.cpp"],
            extra_compile_args=["-O3"],
            cxx_std=17,
        )
    ]


def _requirements():
    lines = (ROOT / "requirements.txt").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


setup(
    name="megatron-lite",
    version="0.1.0",
    description="Megatron-DeepSpeed-compatible pretraining of GPT/BERT/T5 with tensor, sequence, pipeline and data parallelism",
    long_description=(ROOT / "README.md").read_text(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["megatron", "megatron.*"]),
    python_requires=">=3.9",
    install_requires=_requirements(),
    extras_require={"dev": ["pytest>=7", "ruff"]},
    package_data={"megatron.data": ["punkt_english.json"]},
    ext_modules=_ext_modules(),
    zip_safe=False,
)
