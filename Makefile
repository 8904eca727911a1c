# The same verbs for people and CI. `make train` and `make test` set up what they need first.
PYTHON ?= python3
NPROC ?= 2
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# optional frameworks for tests/integrations/test_integrations_*.py (installed by default;
# INTEGRATIONS= skips them)
INTEGRATIONS ?= 1
INTEGRATIONS_SPEC ?= "transformers>=4.57" "accelerate>=1.10" "lightning>=2.5"

.PHONY: deps setup train test test-multinode test-gpu dist-check bench scaling lint clean

deps:
	$(PYTHON) -m pip install -q "$(TORCH_SPEC)"
	$(PYTHON) -m pip install -q -r requirements-dev.txt

setup: deps
	$(PYTHON) -m pip install -q --no-build-isolation -e .
	if [ -n "$(INTEGRATIONS)" ]; then $(PYTHON) -m pip install -q $(INTEGRATIONS_SPEC) "$(TORCH_SPEC)"; fi

train: setup
	$(PYTHON) -m torch.distributed.run --standalone --nproc-per-node $(NPROC) launch_scripts/train/train_gpt.py

test: setup
	$(PYTHON) -m pytest tests -q -m "not cuda and not multigpu" --durations=15 $(PYTEST_ARGS)

# sdist -> wheel from the sdist alone -> clean venv -> smoke test outside the tree (.ci/dist-check)
dist-check: deps
	PYTHON="$(PYTHON)" TORCH_SPEC="$(TORCH_SPEC)" bash .ci/dist-check

# Two torchrun "nodes" on localhost (c10d), HSDP, a resume at another layout, a restart (docs/multinode.md).
test-multinode: setup
	$(PYTHON) -m pytest tests/zero/test_multinode.py -q --durations=5 $(PYTEST_ARGS)

test-gpu:
	$(PYTHON) -m pytest tests -q -m "cuda" $(PYTEST_ARGS)

bench:
	$(PYTHON) launch_scripts/bench/bench_kernels.py

# The step-time model: checks against docs/benchmarks.md, docs/scaling.md's tables and plot.
scaling:
	$(PYTHON) launch_scripts/scaling/scaling_model.py --write-docs

lint:
	$(PYTHON) -m ruff check shardopt tests launch_scripts
	$(PYTHON) -m ruff format --check shardopt tests launch_scripts

clean:
	rm -rf build dist *.egg-info shardopt/*.so shardopt/_build_info.json
