"""Hugging Face folders (``config.json``, ``model.safetensors`` or sharded ``model-0000i-of-0000n.safetensors`` with
``model.safetensors.index.json``, tokenizer files) as a conversion loader and saver.

Families: GPT-2 (``GPT2LMHeadModel``; HF's Conv1D weights are the transposes, c_attn's columns are [q, k, v] x heads,
the MLP activation is the one Megatron computes from the flags: fused bias-GeLU / --openai-gelu = tanh = "gelu_new",
--no-bias-gelu-fusion = erf = "gelu") and the Llama family (``LlamaForCausalLM``, ``MistralForCausalLM``,
``Qwen2ForCausalLM``: Megatron's grouped QKV, SwiGLU [gate; up], RMSNorm, RoPE in HF's half-split layout with no
permutation, ``rope_theta`` -> --rotary-base) with its MoE members ``MixtralForCausalLM`` and ``Qwen2MoeForCausalLM``
(megatron.model.hf_moe_conversion), and BLOOM (``BloomForCausalLM``: --position-embedding-type alibi
--embed-layernorm, the same names and layouts as Megatron-DeepSpeed; megatron/model/hf_bloom.py). The per-tensor
mappings are those of megatron.model.hf_conversion,
applied one layer at a time; tensors are read lazily from the safetensors files.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from megatron.checkpoint_conversion.hf_tokenizer_export import export_tokenizer, write_generation_config
from megatron.checkpoint_conversion.interchange import (
    EMBEDDINGS,
    FINAL_NORM,
    OUTPUT_LAYER,
    ConversionError,
    Message,
    ModelMeta,
    architecture_of,
    expect,
    layer_message,
)
from megatron.model import hf_bloom
from megatron.model import hf_conversion as hfc
from megatron.model import hf_moe_conversion as hfm

LLAMA_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM") + hfm.MOE_ARCHS
GPT2_ARCHS = ("GPT2LMHeadModel",)
BLOOM_ARCHS = ("BloomForCausalLM",)
SUPPORTED = GPT2_ARCHS + LLAMA_ARCHS + BLOOM_ARCHS + (
    "MegatronBertForPreTraining", "MegatronBertForSequenceClassification", "MegatronBertForMultipleChoice")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "vocab.txt", "added_tokens.json", "generation_config.json")
_TANH_GELUS = ("gelu_new", "gelu_fast", "gelu_pytorch_tanh")

# (megatron layer suffix, hf layer suffix, transpose?) for GPT-2 besides c_attn
_GPT2_LAYER = [(m, h, t) for m, h, t in hfc._LAYER_MAP]


# ----------------------------------------------------------------------------------------------- reading
class _LazyTensors:
    """Tensor access by name over the (sharded) safetensors / torch files of a HF folder, one file open at a time."""

    def __init__(self, folder: str, trust: bool) -> None:
        self.folder, self.trust = folder, trust
        self.weight_map: Dict[str, str] = {}
        self._open: Tuple[Optional[str], Any] = (None, None)
        for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            path = os.path.join(folder, index)
            if os.path.isfile(path):
                with open(path) as f:
                    self.weight_map = dict(json.load(f)["weight_map"])
                break
        else:
            for single in ("model.safetensors", "pytorch_model.bin"):
                if os.path.isfile(os.path.join(folder, single)):
                    self.weight_map = {k: single for k in self._keys(single)}
                    break
        if not self.weight_map:
            raise ConversionError(f"--load-dir {folder} has a config.json but no weights (model.safetensors[.index"
                                  ".json] or pytorch_model.bin)")
        for name in sorted(set(self.weight_map.values())):
            if not os.path.isfile(os.path.join(folder, name)):
                raise ConversionError(f"missing weight file {os.path.join(folder, name)} named by the index file")

    def _keys(self, name: str) -> List[str]:
        handle = self._handle(name)
        return list(handle.keys())

    def _handle(self, name: str) -> Any:
        if self._open[0] != name:
            path = os.path.join(self.folder, name)
            if name.endswith(".safetensors"):
                from safetensors import safe_open

                try:
                    handle: Any = safe_open(path, framework="pt")
                except Exception as exc:  # noqa: BLE001 - safetensors raises its own error type (or OSError)
                    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                    raise ConversionError(f"{path} is not a readable safetensors file ({detail}): it is truncated or "
                                          "damaged; download or copy it again") from None
            else:
                from megatron.safe_load import safe_torch_load

                handle = safe_torch_load(path, map_location="cpu", trust=self.trust, mmap=True)
            self._open = (name, handle)
        return self._open[1]

    def __contains__(self, key: str) -> bool:
        return key in self.weight_map

    def keys(self) -> List[str]:
        return list(self.weight_map)

    def get(self, key: str) -> torch.Tensor:
        if key not in self.weight_map:
            raise ConversionError(f"{self.folder}: tensor {key!r} is missing from the weights")
        handle = self._handle(self.weight_map[key])
        return handle.get_tensor(key) if hasattr(handle, "get_tensor") else handle[key]


def _read_config(folder: str) -> Dict[str, Any]:
    if not os.path.isdir(folder):
        raise ConversionError(f"--load-dir {folder} does not exist")
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise ConversionError(f"--load-dir {folder} is not a Hugging Face model folder: no config.json")
    with open(path) as f:
        cfg = json.load(f)
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED:
        raise ConversionError(f"{path}: architecture {arch!r} is not supported by --loader hf "
                              f"(supported: {', '.join(SUPPORTED)})")
    return cfg


def megatron_config_from_hf_gpt2(cfg: Any) -> Dict[str, Any]:
    """Architecture fields for a HF GPT2Config (an object or its dict)."""
    get = cfg.get if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))
    act = get("activation_function", "gelu_new")
    if act not in _TANH_GELUS + ("gelu",):
        raise ConversionError(f"GPT-2 activation_function {act!r} has no Megatron equivalent (gelu_new / gelu)")
    if get("scale_attn_by_inverse_layer_idx", False) or not get("scale_attn_weights", True):
        raise ConversionError("GPT-2 configs with scale_attn_by_inverse_layer_idx or without scale_attn_weights "
                              "are not supported")
    hidden = get("n_embd")
    return dict(num_layers=get("n_layer"), hidden_size=hidden, num_attention_heads=get("n_head"),
                ffn_hidden_size=get("n_inner") or 4 * hidden, kv_channels=hidden // get("n_head"),
                max_position_embeddings=get("n_positions"), padded_vocab_size=get("vocab_size"),
                layernorm_epsilon=get("layer_norm_epsilon", 1e-5), bias_gelu_fusion=act != "gelu",
                share_embeddings_and_output_weights=bool(get("tie_word_embeddings", True)),
                normalization="LayerNorm", position_embedding_type="learned_absolute", add_bias_linear=True)


def _tokenizer_of(folder: str, family: str) -> Dict[str, Any]:
    files = [os.path.join(folder, n) for n in TOKENIZER_FILES if os.path.isfile(os.path.join(folder, n))]
    names = {os.path.basename(f) for f in files}
    tok: Dict[str, Any] = {"files": files}
    if family == "bert" and "vocab.txt" in names:
        lower = True
        if "tokenizer_config.json" in names:
            with open(os.path.join(folder, "tokenizer_config.json")) as f:
                lower = bool(json.load(f).get("do_lower_case", True))
        tok.update(type="BertWordPieceLowerCase" if lower else "BertWordPieceCase", vocab_file="vocab.txt")
    elif family == "gpt2" and {"vocab.json", "merges.txt"} <= names:
        tok.update(type="GPT2BPETokenizer", vocab_file="vocab.json", merge_file="merges.txt")
    elif names & {"tokenizer.json", "tokenizer_config.json"}:
        tok.update(type="HuggingFaceTokenizer", tokenizer_model=".")
    elif "tokenizer.model" in names:
        tok.update(type="Llama2Tokenizer", tokenizer_model="tokenizer.model")
    return tok


def read_hf(load_dir: str, *, true_vocab_size: Optional[int] = None, model_type: str = "GPT",
            trust: bool = False) -> Tuple[ModelMeta, Iterator[Message]]:
    """Loader: (meta, message stream) of a HF GPT-2 / Llama-family folder."""
    cfg = _read_config(load_dir)
    arch = cfg["architectures"][0]
    wanted = "BERT" if arch.startswith("MegatronBertFor") else "GPT"
    if model_type != wanted:
        raise ConversionError(f"{load_dir} holds a {arch}: pass --model-type {wanted}")
    if wanted == "BERT":
        from megatron.checkpoint_conversion.hf_bert import read_hf_bert

        meta, stream = read_hf_bert(load_dir, cfg, _LazyTensors(load_dir, trust))
        meta.tokenizer = _tokenizer_of(load_dir, "bert")
        return meta, stream
    if arch in GPT2_ARCHS:
        fields = megatron_config_from_hf_gpt2(cfg)
        family = "gpt2"
    elif arch in BLOOM_ARCHS:
        import transformers

        hf_config = transformers.AutoConfig.from_pretrained(load_dir, local_files_only=True)
        try:  # BLOOM has no position table; its length limit is a run-time setting (BigScience trained 2048)
            config = hf_bloom.megatron_config_from_hf_bloom(hf_config,
                                                            max_position_embeddings=int(cfg.get("seq_length", 2048)))
        except ValueError as exc:
            raise ConversionError(f"{load_dir}: {exc}") from None
        fields = architecture_of(config)
        family = "bloom"
    else:
        import transformers

        hf_config = transformers.AutoConfig.from_pretrained(load_dir, local_files_only=True)
        try:
            config = (hfm.megatron_config_from_hf_moe(hf_config) if arch in hfm.MOE_ARCHS
                      else hfc.megatron_config_from_hf_llama(hf_config))
        except ValueError as exc:
            raise ConversionError(f"{load_dir}: {exc}") from None
        fields = architecture_of(config)
        family = "llama"
    tensors = _LazyTensors(load_dir, trust)
    vocab = int(fields["padded_vocab_size"])
    meta = ModelMeta(model_type=model_type, architecture=fields, true_vocab_size=true_vocab_size or vocab,
                     iteration=None, tokenizer=_tokenizer_of(load_dir, family), source=load_dir,
                     extra={"hf_architecture": arch, "hf_config": cfg})
    meta.config()  # validates the architecture (one line)
    stream = {"gpt2": _gpt2_stream, "bloom": _bloom_stream, "llama": _llama_stream}[family](tensors, meta)
    return meta, stream


def _heads(meta: ModelMeta) -> Tuple[int, int, int]:
    a = meta.architecture
    nq = a["num_attention_heads"]
    return nq, a.get("num_query_groups") or nq, a.get("kv_channels") or a["hidden_size"] // nq


def _gpt2_stream(t: _LazyTensors, meta: ModelMeta) -> Iterator[Message]:
    pre = "transformer." if "transformer.wte.weight" in t else ""
    nq, _, hd = _heads(meta)
    yield Message(EMBEDDINGS, {"word_embeddings.weight": t.get(pre + "wte.weight"),
                               "position_embeddings.weight": t.get(pre + "wpe.weight")})
    for i in range(meta.architecture["num_layers"]):
        src = f"{pre}h.{i}."
        out = {"self_attention.query_key_value.weight":
               hfc.qkv_hf_to_megatron(t.get(src + "attn.c_attn.weight").t(), nq, hd).contiguous(),
               "self_attention.query_key_value.bias": hfc.qkv_hf_to_megatron(t.get(src + "attn.c_attn.bias"), nq, hd)}
        for m_name, h_name, transpose in _GPT2_LAYER:
            v = t.get(src + h_name)
            out[m_name] = v.t().contiguous() if transpose else v
        yield Message(layer_message(i), out)
    yield Message(FINAL_NORM, {"final_layernorm.weight": t.get(pre + "ln_f.weight"),
                               "final_layernorm.bias": t.get(pre + "ln_f.bias")})
    if not meta.architecture["share_embeddings_and_output_weights"]:
        yield Message(OUTPUT_LAYER, {"output_layer.weight": t.get("lm_head.weight")})


def _bloom_stream(t: _LazyTensors, meta: ModelMeta) -> Iterator[Message]:
    pre = "transformer." if "transformer.word_embeddings.weight" in t else ""
    yield Message(EMBEDDINGS, {"word_embeddings.weight": t.get(pre + "word_embeddings.weight"),
                               "word_embeddings.norm.weight": t.get(pre + "word_embeddings_layernorm.weight"),
                               "word_embeddings.norm.bias": t.get(pre + "word_embeddings_layernorm.bias")})
    for i in range(meta.architecture["num_layers"]):
        yield Message(layer_message(i), {k: t.get(f"{pre}h.{i}.{k}") for k in hf_bloom.LAYER_KEYS})
    yield Message(FINAL_NORM, {"final_layernorm.weight": t.get(pre + "ln_f.weight"),
                               "final_layernorm.bias": t.get(pre + "ln_f.bias")})


def _llama_stream(t: _LazyTensors, meta: ModelMeta) -> Iterator[Message]:
    nq, ng, hd = _heads(meta)
    moe_pattern = meta.config().moe_layer_pattern  # MoE MLP (1) or dense MLP (0) per layer
    shared = bool(meta.architecture.get("moe_shared_expert_intermediate_size"))
    yield Message(EMBEDDINGS, {"word_embeddings.weight": t.get("model.embed_tokens.weight")})
    for i in range(meta.architecture["num_layers"]):
        src = f"model.layers.{i}."
        attn = src + "self_attn."
        out = {"self_attention.query_key_value.weight": hfc.qkv_pack_groups(
            t.get(attn + "q_proj.weight"), t.get(attn + "k_proj.weight"), t.get(attn + "v_proj.weight"), nq, ng, hd)}
        if attn + "q_proj.bias" in t:
            out["self_attention.query_key_value.bias"] = hfc.qkv_pack_groups(
                t.get(attn + "q_proj.bias"), t.get(attn + "k_proj.bias"), t.get(attn + "v_proj.bias"), nq, ng, hd)
        if moe_pattern[i]:
            out.update(hfm.hf_moe_mlp_to_megatron(t.get, src, meta.extra["hf_architecture"],
                                                  meta.architecture["num_moe_experts"], shared))
        else:
            out["mlp.dense_h_to_4h.weight"] = torch.cat([t.get(src + "mlp.gate_proj.weight"),
                                                         t.get(src + "mlp.up_proj.weight")], dim=0)
        for m_name, h_name in hfc._LLAMA_LAYER_MAP:
            if not (moe_pattern[i] and m_name.startswith("mlp.")):
                out[m_name] = t.get(src + h_name)
        yield Message(layer_message(i), out)
    yield Message(FINAL_NORM, {"final_layernorm.weight": t.get("model.norm.weight")})
    if not meta.architecture["share_embeddings_and_output_weights"]:
        head = "lm_head.weight" if "lm_head.weight" in t else "model.embed_tokens.weight"
        yield Message(OUTPUT_LAYER, {"output_layer.weight": t.get(head)})


# ----------------------------------------------------------------------------------------------- writing
def parse_size(text: str) -> int:
    """'5GB', '200MB', '1000' -> bytes."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    s = str(text).strip().upper()
    for unit in sorted(units, key=len, reverse=True):
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * units[unit])
    return int(s)


class _ShardWriter:
    """Writes tensors into safetensors shards of at most `max_bytes`, then the index file (HF's names)."""

    def __init__(self, folder: str, max_bytes: int) -> None:
        self.folder, self.max_bytes = folder, max_bytes
        self.pending: Dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: List[Tuple[str, List[str]]] = []
        self.total = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        size = t.numel() * t.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self.flush()
        t = t.detach()
        if not t.is_contiguous() or t.untyped_storage().nbytes() != size:  # a view: safetensors wants own storage
            t = t.contiguous().clone()
        self.pending[name] = t
        self.pending_bytes += size
        self.total += size

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        tmp = f".shard{len(self.shards):05d}.safetensors"
        save_file({k: v.contiguous() for k, v in self.pending.items()}, os.path.join(self.folder, tmp),
                  metadata={"format": "pt"})
        os.chmod(os.path.join(self.folder, tmp), _file_mode())  # safetensors writes 0600; the rest follows the umask
        self.shards.append((tmp, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> List[str]:
        self.flush()
        n = len(self.shards)
        files = []
        if n == 1:
            os.replace(os.path.join(self.folder, self.shards[0][0]), os.path.join(self.folder, "model.safetensors"))
            return [os.path.join(self.folder, "model.safetensors")]
        weight_map = {}
        for i, (tmp, names) in enumerate(self.shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(os.path.join(self.folder, tmp), os.path.join(self.folder, final))
            files.append(os.path.join(self.folder, final))
            weight_map.update({k: final for k in names})
        with open(os.path.join(self.folder, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": self.total}, "weight_map": weight_map}, f, indent=2)
        return files


def hf_family(meta: ModelMeta) -> str:
    a = meta.architecture
    if a.get("swiglu") and a.get("normalization") == "RMSNorm" and a.get("position_embedding_type") == "rope":
        return "llama"
    if a.get("position_embedding_type") == "alibi" and a.get("embed_layernorm"):
        return "bloom"
    if a.get("position_embedding_type", "learned_absolute") == "learned_absolute" and \
            a.get("normalization", "LayerNorm") == "LayerNorm" and not (a.get("swiglu") or a.get("squared_relu")):
        return "gpt2"
    raise ConversionError("--saver hf: this architecture is neither GPT-2 (learned positions, LayerNorm, GeLU) nor "
                          "Llama-family (--swiglu --normalization RMSNorm --position-embedding-type rope) nor BLOOM "
                          "(--position-embedding-type alibi --embed-layernorm)")


def _hf_config(meta: ModelMeta, family: str, rows: int, arch_name: Optional[str]) -> Any:
    import transformers

    config = meta.config(padded_vocab_size=rows)
    try:
        if family == "gpt2":
            kwargs = hfc.hf_gpt2_config_kwargs(config)
            if config.apply_layernorm_1p or config.apply_residual_connection_post_layernorm or \
                    config.ffn_hidden_size is None or not config.add_bias_linear:
                raise ValueError("HF GPT-2 needs plain pre-LayerNorm layers with biases")
            hf = transformers.GPT2Config(**kwargs)
            hf.architectures = ["GPT2LMHeadModel"]
        elif family == "bloom":
            hf = transformers.BloomConfig(**hf_bloom.hf_bloom_config_kwargs(config, vocab_size=rows))
            hf.architectures = ["BloomForCausalLM"]
        else:
            kwargs = hfc.hf_llama_config_kwargs(config, vocab_size=rows)
            if config.num_moe_experts is not None:
                name = arch_name or hfm.hf_moe_arch(config)
                kwargs.update(hfm.hf_moe_config_kwargs(config, name))
                if name == "Qwen2MoeForCausalLM":
                    kwargs.pop("head_dim", None)
                hf = getattr(transformers, name.replace("ForCausalLM", "Config"))(**kwargs)
                hf.architectures = [name]
                hf.dtype = "float32"
                return hf
            name = arch_name or ("Qwen2ForCausalLM" if config.add_qkv_bias else "LlamaForCausalLM")
            if config.add_qkv_bias and name != "Qwen2ForCausalLM":
                raise ValueError("a QKV bias (--add-qkv-bias) exists only in Qwen2ForCausalLM")
            cls = getattr(transformers, name.replace("ForCausalLM", "Config"))
            if name == "MistralForCausalLM":
                kwargs["sliding_window"] = None
            hf = cls(**kwargs)
            hf.architectures = [name]
    except ValueError as exc:
        raise ConversionError(f"--saver hf: {exc}") from None
    hf.dtype = "float32"
    return hf


def _copy_tokenizer(meta: ModelMeta, out: str) -> List[str]:
    tok = meta.tokenizer
    copied = []
    sources: List[Tuple[str, str]] = [(f, os.path.basename(f)) for f in tok.get("files", [])]
    if tok.get("vocab_file"):
        sources.append((tok["vocab_file"], "vocab.json" if tok.get("merge_file") else "vocab.txt"))
    if tok.get("merge_file"):
        sources.append((tok["merge_file"], "merges.txt"))
    model = tok.get("tokenizer_model")
    if model and os.path.isdir(model):
        sources += [(os.path.join(model, n), n) for n in TOKENIZER_FILES if os.path.isfile(os.path.join(model, n))]
    elif model:
        sources.append((model, "tokenizer.model"))
    for src, name in sources:
        if os.path.isfile(src) and not os.path.exists(os.path.join(out, name)):
            shutil.copyfile(src, os.path.join(out, name))
            copied.append(name)
    return copied


def _file_mode() -> int:
    """The mode open() gives a new file under this process's umask (0644 under the usual 022)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


class _Checked(dict):
    """A message's tensors that remember which keys the saver used (Megatron's check_message)."""

    def __init__(self, tensors: Dict[str, torch.Tensor], name: str) -> None:
        super().__init__(tensors)
        self.name, self.used = name, set()

    def __getitem__(self, key: str) -> torch.Tensor:
        self.used.add(key)
        return super().__getitem__(key)

    def check(self, checking: bool) -> None:
        rest = sorted(set(self) - self.used)
        if rest and checking:
            raise ConversionError(f'message "{self.name}" holds tensors the HF saver does not map ({", ".join(rest)}); '
                                  "if you want to ignore this, use the argument --no-checking")


def write_hf(meta: ModelMeta, messages: Iterator[Message], save_dir: str, *, max_shard_size: str = "2GB",
             hf_architecture: Optional[str] = None, checking: bool = True) -> Dict[str, Any]:
    """Saver: the stream as a HF folder (safetensors shards + index, config.json, tokenizer files)."""
    if meta.model_type == "BERT":
        from megatron.checkpoint_conversion.hf_bert import write_hf_bert

        os.makedirs(save_dir, exist_ok=True)
        summary = write_hf_bert(meta, messages, save_dir, _ShardWriter(save_dir, parse_size(max_shard_size)),
                                checking)
        summary["tokenizer_files"] = _copy_tokenizer(meta, save_dir)
        return summary
    if meta.model_type != "GPT":
        raise ConversionError(f"--saver hf converts GPT and BERT models, not {meta.model_type}")
    family = hf_family(meta)
    a = meta.architecture
    nq, ng, hd = _heads(meta)
    os.makedirs(save_dir, exist_ok=True)
    writer = _ShardWriter(save_dir, parse_size(max_shard_size))
    emb = _Checked(expect(messages, EMBEDDINGS).tensors, EMBEDDINGS)
    rows = meta.true_vocab_size or emb["word_embeddings.weight"].size(0)
    word = emb["word_embeddings.weight"][:rows]
    hf_config = _hf_config(meta, family, rows, hf_architecture)  # validate before writing tensors
    tied = a.get("share_embeddings_and_output_weights", True)
    if family == "gpt2":
        writer.add("transformer.wte.weight", word)
        writer.add("transformer.wpe.weight", emb["position_embeddings.weight"])
    elif family == "bloom":
        writer.add("transformer.word_embeddings.weight", word)
        writer.add("transformer.word_embeddings_layernorm.weight", emb["word_embeddings.norm.weight"])
        writer.add("transformer.word_embeddings_layernorm.bias", emb["word_embeddings.norm.bias"])
    else:
        writer.add("model.embed_tokens.weight", word)
    for i in range(a["num_layers"]):
        layer = _Checked(expect(messages, layer_message(i)).tensors, layer_message(i))
        if family == "gpt2":
            dst = f"transformer.h.{i}."
            qkv = layer["self_attention.query_key_value.weight"]
            writer.add(dst + "attn.c_attn.weight", hfc.qkv_megatron_to_hf(qkv, nq, hd).t().contiguous())
            writer.add(dst + "attn.c_attn.bias",
                       hfc.qkv_megatron_to_hf(layer["self_attention.query_key_value.bias"], nq, hd))
            for m_name, h_name, transpose in _GPT2_LAYER:
                v = layer[m_name]
                writer.add(dst + h_name, v.t().contiguous() if transpose else v)
        elif family == "bloom":
            for key in hf_bloom.LAYER_KEYS:
                writer.add(f"transformer.h.{i}.{key}", layer[key])
        else:
            dst = f"model.layers.{i}."
            q, k, v = hfc.qkv_unpack_groups(layer["self_attention.query_key_value.weight"], nq, ng, hd)
            writer.add(dst + "self_attn.q_proj.weight", q)
            writer.add(dst + "self_attn.k_proj.weight", k)
            writer.add(dst + "self_attn.v_proj.weight", v)
            if "self_attention.query_key_value.bias" in layer:
                q, k, v = hfc.qkv_unpack_groups(layer["self_attention.query_key_value.bias"], nq, ng, hd)
                writer.add(dst + "self_attn.q_proj.bias", q)
                writer.add(dst + "self_attn.k_proj.bias", k)
                writer.add(dst + "self_attn.v_proj.bias", v)
            if hfm.ROUTER in layer:
                for name, tensor in hfm.megatron_moe_mlp_to_hf(layer, dst, hf_config.architectures[0]).items():
                    writer.add(name, tensor)
            else:
                gate, up = layer["mlp.dense_h_to_4h.weight"].chunk(2, dim=0)
                writer.add(dst + "mlp.gate_proj.weight", gate.contiguous())
                writer.add(dst + "mlp.up_proj.weight", up.contiguous())
            for m_name, h_name in hfc._LLAMA_LAYER_MAP:
                if not (hfm.ROUTER in layer and m_name.startswith("mlp.")):
                    writer.add(dst + h_name, layer[m_name])
        layer.check(checking)
    emb.check(checking)
    norm = _Checked(expect(messages, FINAL_NORM).tensors, FINAL_NORM)
    if family in ("gpt2", "bloom"):
        writer.add("transformer.ln_f.weight", norm["final_layernorm.weight"])
        writer.add("transformer.ln_f.bias", norm["final_layernorm.bias"])
    else:
        writer.add("model.norm.weight", norm["final_layernorm.weight"])
    norm.check(checking)
    if not tied:
        writer.add("lm_head.weight", expect(messages, OUTPUT_LAYER).tensors["output_layer.weight"][:rows])
    rest = next(messages, None)
    if rest is not None:
        raise ConversionError(f'unexpected message "{rest.name}" after the model (is --model-type right?)')
    files = writer.close()
    copied = _copy_tokenizer(meta, save_dir)
    exported = export_tokenizer(meta.tokenizer, save_dir, a.get("max_position_embeddings"))
    for key in ("bos_token_id", "eos_token_id"):
        if exported[key] is not None:
            setattr(hf_config, key, exported[key])
    hf_config.save_pretrained(save_dir)
    copied += exported["files"] + write_generation_config(save_dir, exported["bos_token_id"],
                                                          exported["eos_token_id"])
    return {"files": files, "architecture": hf_config.architectures[0], "tokenizer_files": copied,
            "vocab_size": rows}
