"""One engine round, phase by phase: draft → schedule → verify → commit, then the drafter is fed the target
features of what stayed in the cache. `Engine._round` (engine.py) calls them in that order; prefill.py holds
how admitted prompts are grouped into forwards."""
