"""The packed forward: per-document attention (its kernels, the chunked and indexed kinds), the token mixers and
rotary tables that must see each document alone, the router's load-balancing loss."""
