#!/usr/bin/env bash
# promtool on deploy/prometheus: the scrape config, the rules, and the rules' unit tests.
# Usage: check_promtool.sh SOURCE_DIR
set -euo pipefail
NQ_ROOT=${1:?usage: check_promtool.sh SOURCE_DIR}
source "$(dirname "$0")/lib.sh"
need promtool
cd "$NQ_ROOT/deploy/prometheus"
promtool check config prometheus.yml
promtool check rules alerts.yml
promtool test rules tests/alerts_test.yml
