"""The public API: the functions (public), plan/run (attention), the paged
cache pool (cache), KV writes (kv_write), flash-attn's conventions and
function (conventions, flash_attn), and the torch custom ops registered
around the eager calls (torch_ops). turbine_fmha re-exports the public
names."""
