"""A call, from arguments to kernel calls: the mask rule (mask), validation
into a frozen Problem (problem), group mode, gappy KV and non-paged caches
(modes), and the kernel calls of a plan (plan). Pure numpy: nothing here
loads or runs a kernel."""
