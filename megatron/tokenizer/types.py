"""The `--tokenizer-type` values megatron.tokenizer builds (a leaf module: the flag declaration imports it)."""

TOKENIZER_TYPES = ("GPT2BPETokenizer", "BertWordPieceLowerCase", "BertWordPieceCase", "SentencePieceTokenizer",
                   "Llama2Tokenizer", "PretrainedFromHF", "HuggingFaceTokenizer", "NullTokenizer", "SFTTokenizer")
