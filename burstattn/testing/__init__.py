"""What tests, benchmarks and the demo run on, beside the library's call path.

* :mod:`.oracle`: the float64 oracle (plain PyTorch attention over the full sequence).
* :mod:`.launch`: :class:`~.launch.LocalPool` / :func:`~.launch.run_local`, a group of local
  processes started once and reused (tests, ``burstattn demo | bench | train | generate``).
* :mod:`.accelerate_env`: :func:`~.accelerate_env.local_group_environment`, accelerate's view of such
  a group (the Hugging Face Trainer tests and benchmark).
"""
