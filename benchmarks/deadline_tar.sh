#!/usr/bin/env bash
# Pack what a device call has written so far, at a deadline, so that a call cut by its time
# limit still brings its files back (session 35's first run lost them all: the script's
# `timeout -s INT` waited on a child that outlived it, and the final tar never ran).
#   bash bench/deadline_tar.sh SECONDS OUTDIR TGZ &     (then the call's own final tar)
# Writes TGZ's name with -partial before .tgz, so that it never races the final one.
set -u
# the sleep as a child waited on, so that the TERM of an early finish (the caller's EXIT trap)
# ends it too rather than leaving it to outlast the call
sleep "$1" &
SLEEPER=$!
trap 'kill $SLEEPER 2>/dev/null; exit 0' TERM
wait $SLEEPER
tar czf "${3%.tgz}-partial.tgz" -C "$2" . 2>/dev/null
