"""The other engines the benchmarks compare with: CTranslate2 and transformers conversions of the
embedded GGUF (ctranslate2.py), llama.cpp's own binaries (llama_cpp.py, built by build_llama_cpp.sh)."""
