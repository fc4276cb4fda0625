# The two commands of the README (each sets up first when needed; ./setup.sh is idempotent):
#   make demo   the main job: the demo on the built-in simulated arm and default policy
#   make test   the test suite (what CI runs)
# Extra: make setup | make bench-quick | make clean
SHELL := /bin/bash
PYTEST_ARGS ?=
DEMO_ARGS ?=

.PHONY: setup demo test bench-quick clean

setup:
	./setup.sh

demo: setup
	. scripts/env.sh && capsule-ros demo $(DEMO_ARGS)

test: setup
	. scripts/env.sh && python -m pytest test -q -p no:cacheprovider $(PYTEST_ARGS)

bench-quick: setup
	. scripts/env.sh && for b in snapshot step reenter services loop; do capsule-ros bench $$b --quick; done

clean:
	rm -rf build install log .venv
