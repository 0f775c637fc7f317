"""Reference backend: a paged-attention Llama and workers for every algorithm."""
