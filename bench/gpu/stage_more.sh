#!/usr/bin/env bash
# The rest of the staged-TP bench rows after stage.sh in a second call (bench rows only).
STAGE_TESTS=0 STAGE_RATIOS=${STAGE_RATIOS:-"4:1 2:4"} bash "$(dirname "$0")/stage.sh"
