# Two commands a newcomer needs:  `make train`  and  `make test`.
# Both create .venv with a Python >= 3.12 (found by scripts/find_python.sh) when it is missing.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
CONFIG ?= configs/lm.py:mixer=hla2,size=tiny
WORKDIR ?= runs/tiny-hla2

.PHONY: venv train test lint clean

$(STAMP): setup.cfg pyproject.toml
	@test -x $(PY) || "$$(sh scripts/find_python.sh)" -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@touch $(STAMP)

venv: $(STAMP)

train: $(STAMP)
	$(PY) -m hla_jax.main --config=$(CONFIG) --workdir=$(WORKDIR)

test: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict
	$(PY) -m pytest -q -n 2 --durations=15

lint: $(STAMP)
	$(VENV)/bin/ruff check hla_jax tests experiments configs notebooks

clean:
	rm -rf $(VENV) runs build .pytest_cache .hypothesis
