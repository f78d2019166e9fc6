"""`vllm-kvq calibrate`: nuq codebooks, KVQuant-style. Per layer, for keys and values
separately, 2^b levels on normalized values (normalize.py: exactly the serve-time scale
groups), fitted by weighted 1-D k-means (kmeans.py) on histograms of post-RoPE keys and
values captured from a transformers model, weighted by each element's Fisher information
(hooks.py, collect.py); written in the file format serving reads (vllm_kvq/codebook_file.py);
optionally measured on held-out text (evaluate.py). The command: cli.py."""
