"""Model definitions, weight loading (Hugging Face directories and GGUF) and the
tokenizer."""
