# symlib and the living paper. `make book` and `make test` do all the set-up on a fresh machine.
SHELL := /bin/bash
.ONESHELL:
.SHELLFLAGS := -eu -o pipefail -c

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
SCALE  ?= cpu
DEVICE ?= cpu
ALL_CHAPTERS := $(basename $(notdir $(wildcard notebooks/*.md)))
# Longest first (measured at scale=cpu), so that parallel lanes end together; chapters not listed run last.
LONGEST_FIRST := alignment table1 true_posterior collapse transformers toy own_network permfreq minmass architectures marginals
CHAPTERS ?= $(filter $(ALL_CHAPTERS),$(LONGEST_FIRST)) $(filter-out $(LONGEST_FIRST),$(ALL_CHAPTERS))
# Chapters that load the shared caches (make zoo); table1 also loads its sample sets.
ZOO_CHAPTERS := minmass table1 true_posterior collapse alignment transformers
# Chapters run in LANES parallel lanes, JOBS at most (default: 2 on a CPU, since many cells are small
# operations that one core runs as fast as two and kernel start-up is serial; 1 on a GPU), never more
# lanes than chapters or cores; each lane gets NCPU / LANES intra-op threads (torch, OpenMP, BLAS), so
# that lanes x threads never exceed the cores.
NCPU := $(shell nproc 2>/dev/null || echo 1)
JOBS ?= $(if $(filter cpu,$(DEVICE)),$(if $(filter 1,$(NCPU)),1,2),1)
LANES = $(shell j=$(JOBS); c=$(words $(CHAPTERS)); [ $$c -lt $$j ] && j=$$c; [ $$j -gt $(NCPU) ] && j=$(NCPU); \
                [ $$j -ge 1 ] && echo $$j || echo 1)
LANE_THREADS = $(shell n=$$(( $(NCPU) / $(LANES) )); [ $$n -ge 1 ] && echo $$n || echo 1)
BUILD  := build
# teacher: solutions as toggles (build/_build/html); student: every solution removed (build/student/_build/html)
EDITION ?= teacher
HTML_OUT := $(if $(filter student,$(EDITION)),$(BUILD)/student,$(BUILD))
FASHION_DIR := /usr/share/datasets/fashion-mnist

# Caches stay inside the build folder, so runs leave nothing behind.
export MPLCONFIGDIR := $(CURDIR)/$(BUILD)/cache/matplotlib
export IPYTHONDIR := $(CURDIR)/$(BUILD)/cache/ipython
export JUPYTER_CONFIG_DIR := $(CURDIR)/$(BUILD)/cache/jupyter
export JUPYTER_DATA_DIR := $(CURDIR)/$(BUILD)/cache/jupyter-data
export PYDEVD_DISABLE_FILE_VALIDATION := 1
export SYMLIB_CACHE ?= $(CURDIR)/$(BUILD)/zoo-cache
# Bytecode is written as modules are first imported (Python's default), also where the environment sets
# PYTHONDONTWRITEBYTECODE: a process then reads the compiled modules that an earlier one wrote, instead of
# compiling every module it imports again (torch's and the chapters' libraries: 13 s instead of 6). Only the
# modules the commands import are compiled (about 4,300 for the chapters), not the venv's 21,700 files.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: help env data zoo book chapters chapter static html html-both book-check test unit nbval lint bench clean lab
.PHONY: check check-chapters check-tiny-and-book unit-fast book-check-teacher
.PHONY: slides assignments grade cuda-check
help:
	@echo "make book   - environment + shared zoo + every chapter (SCALE=$(SCALE) DEVICE=$(DEVICE)) + HTML book"
	@echo "make test   - environment + lint + unit/property tests + shared zoo + nbval + the strict book, both editions"
	@echo "make check  - before every commit: lint + unit tests (not the slow ones) + every chapter at scale=tiny (build/check/) + the strict book (teacher edition)"
	@echo "make zoo    - train (or check) the zoo and Table 1's sample sets the chapters share (SYMLIB_CACHE)"
	@echo "make bench  - run every benchmark under benchmarks/"
	@echo "make cuda-check - on a GPU: the CUDA tests, make zoo's caches on cuda, the GPU benchmarks"
	@echo "make chapters CHAPTERS='toy' SCALE=tiny - run some chapters only (JOBS=$(JOBS) at a time)"
	@echo "make html [EDITION=student] - HTML only, from the committed chapters (student: no solutions)"
	@echo "make html-both - both editions, strictly (build/_build/html, build/student/_build/html)"
	@echo "make lab    - JupyterLab on notebooks/: the chapters open as notebooks through jupytext, MyST rendered"
	@echo "make slides - one reveal.js deck per chapter, from the committed chapters (build/slides)"
	@echo "make assignments [SCALE=cpu] - nbgrader notebooks of the computational exercises (build/assignments)"
	@echo "make grade SUBMISSIONS=dir - grade dir/<student>/<chapter>.ipynb (build/grades/grades.csv)"

env: $(VENV)/.installed data

# The lock is installed by uv (pinned below, itself installed by pip), with pip's own package sources
# (tools/uv_sources.py: on machines whose pip takes torch from a local index, uv takes it from there too),
# unpacking wheels on every core into a cache in the build folder that the venv hard-links: 18 s against
# pip's 63 s for the same 265 packages (docs/performance.md). INSTALLER=pip, or no uv to be had, installs
# with pip alone.
UV_VERSION := 0.13.9
INSTALLER ?= uv
export UV_CACHE_DIR ?= $(CURDIR)/$(BUILD)/cache/uv
$(VENV)/.installed: requirements.lock pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	case "$(INSTALLER)" in uv|pip) ;; *) echo "INSTALLER=$(INSTALLER): expected uv or pip" >&2; exit 2;; esac
	if [ "$(INSTALLER)" = uv ] && $(PY) -m pip install -q --no-compile uv==$(UV_VERSION); then
	  sources=$$($(PY) tools/uv_sources.py $(PY))
	  $(VENV)/bin/uv pip install -q --python $(PY) --index-strategy unsafe-best-match $$sources -r requirements.lock
	  $(VENV)/bin/uv pip install -q --python $(PY) --no-deps --no-build-isolation -e .
	else
	  [ "$(INSTALLER)" = pip ] || echo "warning: could not install uv $(UV_VERSION); installing with pip (slower)" >&2
	  $(PY) -m pip install -q --upgrade pip
	  $(PY) -m pip install -q --no-compile -r requirements.lock
	  $(PY) -m pip install -q --no-compile --no-deps --no-build-isolation -e .
	fi
	touch $@

# FashionMNIST ships in Debian's dataset-fashion-mnist (the default out-of-distribution set); Debian's
# chromium is the browser that tests the slides (tests/test_slides.py skips that test without it).
data:
	@if [ -d $(FASHION_DIR) ] && command -v chromium >/dev/null; then exit 0; fi
	if [ "$$(id -u)" = 0 ]; then SUDO=""; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; else SUDO=none; fi
	if [ "$$SUDO" != none ] && command -v apt-get >/dev/null; then
	  $$SUDO apt-get update -qq >/dev/null 2>&1 || true
	  [ -d $(FASHION_DIR) ] || DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1 \
	    || echo "warning: could not install dataset-fashion-mnist; symlib.data will explain how to get FashionMNIST"
	  command -v chromium >/dev/null || DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium >/dev/null 2>&1 \
	    || echo "warning: could not install chromium; the slides' browser test will be skipped"
	else
	  echo "warning: no root/apt: install Debian's dataset-fashion-mnist for the FashionMNIST chapters"
	  echo "warning: no root/apt: install Debian's chromium for the slides' browser test"
	fi

# The zoo the chapters share (1,000 OptuNets: min-mass, collapse, alignment, Table 1) and Table 1's sample
# sets, trained as a step of their own with progress bars, so that no chapter cell (and no nbval cell,
# with its per-cell time-out) carries minutes of training. A complete cache is only checked (seconds).
zoo: $(VENV)/.installed
	$(PY) -m symlib.paper.caches --scale $(SCALE) --device $(DEVICE)

# The phases of a target, one make target each in order (the shared caches, filled or checked by `zoo`,
# are not checked again by the chapters), then how long each took: also printed when one fails.
define phases
	declare -a done_phases=()
	report() { echo "== make $@: phase times"; for p in "$${done_phases[@]}"; do echo "   $$p"; done; }
	trap report EXIT
	for phase in $(1); do
	  start=$$(date +%s)
	  $(MAKE) --no-print-directory $$phase CACHES_READY=1
	  done_phases+=("$$(printf '%-14s %5d s' $$phase $$(( $$(date +%s) - start )))")
	done
endef

book:
	$(call phases,env zoo chapters html)

# The shared caches are filled (or checked, seconds) before the lanes start, so that two chapters never
# train the same zoo at once; CACHES_READY=1 skips that when `make zoo` has just done it (make book, make test).
CHECK_CACHES = $(if $(CACHES_READY),echo "== the shared caches: checked by make zoo",\
  $(if $(filter $(ZOO_CHAPTERS),$(CHAPTERS)),$(PY) -m symlib.paper.caches --scale $(SCALE) --device $(DEVICE) \
  $(if $(filter table1,$(CHAPTERS)),,--no-table1) \
  $(if $(filter true_posterior,$(CHAPTERS)),--true-posterior,--no-true-posterior)))
chapters: $(VENV)/.installed
	mkdir -p $(MPLCONFIGDIR) $(IPYTHONDIR)
	$(CHECK_CACHES)
	echo "== $(words $(CHAPTERS)) chapter(s), $(LANES) at a time, $(LANE_THREADS) thread(s) each (scale=$(SCALE), device=$(DEVICE))"
	start=$$(date +%s)
	$(PY) -m symlib.paper.lanes $(CHAPTERS) --scale $(SCALE) --device $(DEVICE) --lanes $(LANES) \
	  --threads $(LANE_THREADS) --work $(NB_DIR) --out $(CHAPTER_OUT)
	echo "== chapters done in $$(( $$(date +%s) - start )) s"

# One chapter (CH): converted from notebooks/ by jupytext, executed by papermill with the parameters, the
# parameters folded, in book/$(CH).ipynb (NB_DIR: the working copies; CHAPTER_OUT: where the executed
# chapter goes; make check: build/check/). `make chapters` runs them in lanes of one process each
# (symlib.paper.lanes: papermill imported once per lane, a fresh kernel per chapter).
NB_DIR := $(BUILD)/nb
CHAPTER_OUT := book
chapter: $(VENV)/.installed
	if [ -z "$(CH)" ] || [ ! -f notebooks/$(CH).md ]; then
	  echo "make chapter CH=<name>: one of $(ALL_CHAPTERS)" >&2; exit 2
	fi
	mkdir -p $(MPLCONFIGDIR) $(IPYTHONDIR)
	$(PY) -m symlib.paper.lanes $(CH) --scale $(SCALE) --device $(DEVICE) --threads $(or $(THREADS),$(NCPU)) \
	  --work $(NB_DIR) --out $(CHAPTER_OUT)

# MathJax is served from the book itself (the django-static-mathjax wheel ships MathJax 3), so math
# renders when the HTML is opened offline.
MATHJAX := $(BUILD)/static/mathjax
# The strict build: a warning is an error (-W) and every cross-reference must resolve (-n, nitpicky);
# --keep-going reports all of them before failing. `make html`, `make html-both` and the test of the
# test (tests/book/test_strict_build.py) all use these flags.
JB_FLAGS := -W -n --keep-going
static: $(VENV)/.installed
	src=$$($(PY) -c "import mathjax, pathlib; print(pathlib.Path(mathjax.__file__).parent / 'static/mathjax/es5')")
	rm -rf $(MATHJAX); mkdir -p $(MATHJAX)
	cp -r $$src/tex-mml-chtml.js $$src/a11y $$src/adaptors $$src/input $$src/output $$src/sre $$src/ui $(MATHJAX)/

html: static
	case "$(EDITION)" in teacher|student) ;; *) echo "EDITION=$(EDITION): expected teacher or student" >&2; exit 2;; esac
	BOOK_EDITION=$(EDITION) $(VENV)/bin/jupyter-book build . $(JB_FLAGS) --path-output $(HTML_OUT)
	echo "The $(EDITION) edition of the book is at file://$(CURDIR)/$(HTML_OUT)/_build/html/index.html"

# Both editions, strictly, from one parsed environment: the edition only changes what is written, so the
# student edition is written first, moved to build/student/, and the teacher edition is rewritten from
# the same doctrees (about half the time of two separate builds).
html-both: static
	rm -rf $(BUILD)/student/_build/html
	BOOK_EDITION=student $(VENV)/bin/jupyter-book build . $(JB_FLAGS) --path-output $(BUILD)
	mkdir -p $(BUILD)/student/_build
	mv $(BUILD)/_build/html $(BUILD)/student/_build/html
	BOOK_EDITION=teacher $(VENV)/bin/jupyter-book build . $(JB_FLAGS) --path-output $(BUILD)
	echo "The teacher edition is at file://$(CURDIR)/$(BUILD)/_build/html/index.html, the student edition at file://$(CURDIR)/$(BUILD)/student/_build/html/index.html"

# The book as a gate: both editions built strictly from the committed chapters (API reference included),
# then checked (every solution in the teacher's pages and none in the student's; a broken reference
# fails the build: tests/book/).
book-check: html-both
	SYMLIB_REQUIRE_BUILT_BOOK=1 $(PY) -m pytest -q -p no:cacheprovider tests/book

# make check's book: the teacher's edition only, strictly (its checks; the student's edition differs by the
# solutions it leaves out, which `make test` checks with both editions): 52 s instead of 89 alone.
book-check-teacher: html
	SYMLIB_REQUIRE_BUILT_BOOK=1 SYMLIB_BOOK_EDITIONS=teacher $(PY) -m pytest -q -p no:cacheprovider tests/book

# Every check, one phase after the other, and at the end how long each took (also when one fails).
TEST_PHASES := env lint unit zoo nbval book-check
test:
	$(call phases,$(TEST_PHASES))

# The fast inner loop, before every commit: ruff, the unit tests but the slow ones (unit-fast), every chapter
# executed at scale=tiny (each asserts its own claims; a cell error fails the phase) and the strict book from
# the committed chapters (the teacher's edition: book-check-teacher), stopping at the first failure. The tiny
# chapters run in the lanes of `make chapters` into build/check/nb only (a failed one's partly executed copy:
# build/check/src/<chapter>.out.ipynb), never into book/*.ipynb, which hold the committed cpu-scale
# chapters; `make zoo` at scale=tiny fills their caches first, in a folder of their own (every cache key
# holds the scale, or sampler settings that differ per scale, but so build/zoo-cache stays as make zoo
# left it).
# The tiny chapters and the strict book share a phase, side by side (check-tiny-and-book): neither reads what
# the other writes, and the book's single process fills what the lanes leave of the cores (their kernels'
# start-up is serial); the book's output goes to build/check/book-check.log, shown when it fails.
CHECK_PHASES := lint unit-fast check-tiny-and-book
CHECK_DIR := $(BUILD)/check
CHECK_CACHE := $(CURDIR)/$(BUILD)/zoo-cache-tiny
check:
	$(call phases,$(CHECK_PHASES))

check-tiny-and-book: $(VENV)/.installed
	mkdir -p $(CHECK_DIR)
	log=$(CHECK_DIR)/book-check.log
	rm -f $$log.rc
	start=$$(date +%s)
	( rc=0; $(MAKE) --no-print-directory book-check-teacher EDITION=teacher >$$log 2>&1 || rc=$$?; echo $$rc >$$log.rc ) &
	book=$$!
	trap 'kill $$book 2>/dev/null || true' INT TERM
	rc=0; $(MAKE) --no-print-directory check-chapters || rc=$$?
	echo "== the tiny chapters: $$([ $$rc = 0 ] && echo green || echo FAILED) in $$(( $$(date +%s) - start )) s"
	wait $$book || true
	brc=$$(cat $$log.rc 2>/dev/null || echo 1)
	if [ "$$brc" != 0 ]; then tail -n 80 $$log; fi
	echo "== the strict book and its checks: $$([ $$brc = 0 ] && echo green || echo FAILED) in" \
	  "$$(( $$(date +%s) - start )) s from the phase's start (log: $$log)"
	[ $$rc = 0 ] && [ $$brc = 0 ]

check-chapters: $(VENV)/.installed
	TQDM_DISABLE=1 $(MAKE) --no-print-directory zoo SCALE=tiny DEVICE=cpu SYMLIB_CACHE=$(CHECK_CACHE)
	$(MAKE) --no-print-directory chapters SCALE=tiny DEVICE=cpu CACHES_READY=1 SYMLIB_CACHE=$(CHECK_CACHE) \
	  NB_DIR=$(CHECK_DIR)/src CHAPTER_OUT=$(CHECK_DIR)/nb

# On a shared machine, OpenMP threads that spin while they wait for a descheduled sibling made small-op
# cells 5-10x slower under one competing process: the tests let waiting threads sleep (OMP_WAIT_POLICY).
# The unit tests run on UNIT_WORKERS pytest-xdist workers of NCPU / UNIT_WORKERS intra-op threads each
# (the built book's checks, tests/book, run in `make book-check`).
UNIT_WORKERS ?= $(if $(filter 1,$(NCPU)),1,2)
UNIT_THREADS = $(shell n=$$(( $(NCPU) / $(UNIT_WORKERS) )); [ $$n -ge 1 ] && echo $$n || echo 1)
unit: $(VENV)/.installed
	OMP_NUM_THREADS=$(UNIT_THREADS) MKL_NUM_THREADS=$(UNIT_THREADS) OPENBLAS_NUM_THREADS=$(UNIT_THREADS) \
	OMP_WAIT_POLICY=$${OMP_WAIT_POLICY:-PASSIVE} $(PY) -m pytest -q -n $(UNIT_WORKERS) --dist worksteal \
	  $(if $(UNIT_MARKS),-m "$(UNIT_MARKS)") --ignore=tests/book tests

# make check's unit tests: all but those marked slow (pyproject.toml: end to end, several seconds each, such as
# nbgrader grading whole notebooks or a browser opening the slides), which make test runs. A target-specific
# variable: it reaches the unit recipe, not the environment of the tests (which run make themselves).
unit-fast: UNIT_MARKS := not slow
unit-fast: unit

# Re-executes the committed chapters and compares the outputs of the cells tagged nbval-check-output (the
# `:tags:` of a cell in notebooks/<name>.md), in the lanes of `make chapters` (one pytest per chapter, LANES
# at a time, longest first, LANE_THREADS threads each).
nbval: $(VENV)/.installed
	mkdir -p $(MPLCONFIGDIR) $(IPYTHONDIR)
	$(CHECK_CACHES)
	echo "== nbval over $(words $(CHAPTERS)) chapter(s), $(LANES) at a time, $(LANE_THREADS) thread(s) each"
	start=$$(date +%s)
	printf '%s\n' $(CHAPTERS) | xargs -P $(LANES) -I{} env OMP_NUM_THREADS=$(LANE_THREADS) \
	  MKL_NUM_THREADS=$(LANE_THREADS) OPENBLAS_NUM_THREADS=$(LANE_THREADS) TQDM_DISABLE=1 \
	  OMP_WAIT_POLICY=$${OMP_WAIT_POLICY:-PASSIVE} $(PY) -m pytest -q -p no:cacheprovider --nbval-lax \
	  --nbval-current-env --nbval-sanitize-with .ci/nbval_sanitize.cfg book/{}.ipynb
	echo "== nbval done in $$(( $$(date +%s) - start )) s"

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check symlib tests benchmarks course tools

# The course: JupyterLab on the chapter sources, where a double click opens a chapter's .md as a notebook
# (jupytext) whose text renders as MyST (jupyterlab-myst, pinned in requirements.lock: directives such as
# {exercise}, roles such as {term}, math); its settings stay in the build folder.
LAB_SETTINGS := $(CURDIR)/$(BUILD)/cache/lab/user-settings
lab: env
	mkdir -p $(LAB_SETTINGS)/@jupyterlab/docmanager-extension
	echo '{"defaultViewers": {"markdown": "Jupytext Notebook", "myst": "Jupytext Notebook"}}' \
	  > $(LAB_SETTINGS)/@jupyterlab/docmanager-extension/plugin.jupyterlab-settings
	JUPYTERLAB_SETTINGS_DIR=$(LAB_SETTINGS) JUPYTERLAB_WORKSPACES_DIR=$(CURDIR)/$(BUILD)/cache/lab/workspaces \
	  $(VENV)/bin/jupyter lab --ServerApp.root_dir=$(CURDIR)/notebooks

bench: $(VENV)/.installed
	for b in benchmarks/*.py; do echo "== $$b"; $(PY) $$b; done

# On a machine with CUDA (docs/performance.md, "On a GPU"): every CUDA-only test, make zoo's caches at the
# cpu scale produced on the GPU (in a cache of their own, so the CPU's stay untouched), the GPU benchmarks.
cuda-check: $(VENV)/.installed
	$(PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else \
	  'make cuda-check needs a GPU: torch.cuda.is_available() is False here')"
	$(PY) -m pytest -q -p no:cacheprovider -rs -k cuda tests
	SYMLIB_CACHE=$(CURDIR)/$(BUILD)/zoo-cache-cuda $(PY) -m symlib.paper.caches --scale cpu --device cuda
	$(PY) benchmarks/zoo_training.py --device cuda
	$(PY) benchmarks/pairwise_mi.py --device cuda

clean:
	rm -rf $(BUILD) _build .pytest_cache .hypothesis

# The teaching kit (book/course/in_class.md). Slides: one reveal.js deck per chapter of _toc.yml, from its
# committed notebook (course/slides.py says what goes on a slide), offline. Assignments: the
# computational exercises as nbgrader notebooks with hidden tests, graded at SCALE; `make grade` grades
# a folder of submissions locally (no docker), JOBS at a time, into build/grades/, merging into the table
# there (FRESH=1 starts it over; TIMEOUT=<s> sets a cell's time limit). Each writes only into a folder it
# made (.symlib-course.json) or an empty one, and refuses, exit status 2, before writing anything.
slides: $(VENV)/.installed
	$(PY) -m course slides --out $(BUILD)/slides
	echo "The decks are at file://$(CURDIR)/$(BUILD)/slides/index.html"

# the chapters of `make assignments CHAPTERS="toy minmass"` (given on the command line), else every one
ASSIGNED = $(if $(filter command line environment,$(origin CHAPTERS)),$(CHAPTERS))

assignments: $(VENV)/.installed
	$(PY) -m course assignments --course $(BUILD)/assignments --scale $(SCALE) $(if $(TIMEOUT),--timeout $(TIMEOUT)) $(ASSIGNED)
	echo "Hand out $(BUILD)/assignments/release/<chapter>/<chapter>.ipynb"

grade: $(VENV)/.installed
	if [ -z "$(SUBMISSIONS)" ]; then echo "make grade SUBMISSIONS=<folder>: <folder>/<student>/<chapter>.ipynb" >&2; exit 2; fi
	$(PY) -m course grade "$(SUBMISSIONS)" --course $(BUILD)/assignments --out $(BUILD)/grades --jobs $(JOBS) \
	  $(if $(TIMEOUT),--timeout $(TIMEOUT)) $(if $(FRESH),--fresh)
