"""Running artifacts: the Session (session), its default directories
(paths), calling a loaded artifact (invoke), which variant serves a call
(selection), host memory and torch tensors in and out of IREE buffers
(interop), and the plans of recent one-shot calls (plan_cache). numpy and
iree-base-runtime only."""
