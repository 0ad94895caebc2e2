"""Offline evaluation of exported Hugging Face models on tasks built from shipped text
(``lrattn-eval``): held-out perplexity and bits per byte, last-word cloze, next-line choice."""
