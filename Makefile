VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

.PHONY: demo test test-fast bench docs lint clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install --upgrade pip
	# torch first, pinned: the local CPU build; anything else downloads a CUDA build.
	$(PIP) install torch==2.13.0
	$(PIP) install -e ".[test]"
	touch $@

DEMO := configs/lora_minilm_intents.toml

demo: $(VENV)/.installed
	$(VENV)/bin/peftx finetune $(DEMO) --overwrite
	$(PY) examples/peft_check.py runs/lora_minilm_intents $(DEMO)

test: $(VENV)/.installed
	$(PY) -m pytest -q -n auto --durations=25

# everything but the slow markers (pyproject.toml): the edit-test loop
test-fast: $(VENV)/.installed
	PEFTX_FAST_TESTS=1 $(PY) -m pytest -q -n auto --dist loadfile --durations=25 \
		-o addopts="-ra --strict-markers" \
		-m "not (command_run or simulated_devices or torch_round_trip or zoo_sweep or layout_sweep or variant_sweep)"

bench: $(VENV)/.installed
	$(PY) benchmarks/suite.py --out benchmarks/RESULTS.md
	$(PY) benchmarks/implicit_overhead.py
	$(PY) benchmarks/lora_step.py
	$(PY) benchmarks/quantized_matmul.py
	$(PY) benchmarks/scan_layers.py
	$(PY) benchmarks/load_checkpoint.py
	$(PY) benchmarks/adapter_io.py

docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check peftx tests examples benchmarks
	$(VENV)/bin/ruff format --check peftx tests examples benchmarks

clean:
	rm -rf $(VENV) site
