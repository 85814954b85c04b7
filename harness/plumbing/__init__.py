"""Plumbing: what every stage of the pipeline stands on and none of it is about Kokoro.

- `files`: atomic writes and the one function that makes content keys;
- `cache`: content-keyed entries, built once under a lock, pruned least-recently-used first;
- `jobs`: an export, compile or run described as files and executed in a child process;
- `admission`: compiles wait for the memory their last run peaked at;
- `worker`: children started before their job: a warm, torch-free one for a port chain's small ONNX
  jobs, and a one-job spare that imports a run's runtime while its artifact compiles;
- `targets`: where a run job executes (this machine, or a device over SSH);
- `hooks`: forward hooks removed whatever the forward pass does.
- `heap`: freed heap pages given back to the system after each item (a long run's size grows otherwise);
- `stopping`: SIGTERM in the harness's main process ends a run as Ctrl-C does, cleaning up;
- `errors`: what the user got wrong (`UsageError`: one line, exit 2) apart from the harness's own defects.
"""
