# Two commands for a fresh machine: `make demo` and `make test`. Each makes its own virtualenv.
PYTHON ?= python3
DEMO_VENV := .venv-demo
TEST_VENV := .venv

.PHONY: demo test lint config-docs module-map clean

$(DEMO_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(DEMO_VENV)
	$(DEMO_VENV)/bin/pip install --quiet --upgrade pip
	$(DEMO_VENV)/bin/pip install --quiet -e .
	touch $@

$(TEST_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(TEST_VENV)
	$(TEST_VENV)/bin/pip install --quiet --upgrade pip
	$(TEST_VENV)/bin/pip install --quiet -e '.[dev]'
	touch $@

demo: $(DEMO_VENV)/.installed
	$(DEMO_VENV)/bin/marsproxy demo

test: $(TEST_VENV)/.installed
	$(TEST_VENV)/bin/pytest -q

# lint-imports: the layers of docs/architecture.md ([tool.importlinter] in pyproject.toml).
lint: $(TEST_VENV)/.installed
	$(TEST_VENV)/bin/ruff check marsproxy tests
	$(TEST_VENV)/bin/mypy
	$(TEST_VENV)/bin/lint-imports

config-docs: $(TEST_VENV)/.installed
	$(TEST_VENV)/bin/python scripts/config_docs.py docs/configuration.md configs/marsproxy.yaml

module-map:
	$(PYTHON) scripts/module_map.py docs/architecture.md

clean:
	rm -rf $(DEMO_VENV) $(TEST_VENV) .pytest_cache .mypy_cache .ruff_cache
