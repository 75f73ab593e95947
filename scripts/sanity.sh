#!/usr/bin/env bash
# ansible-test sanity, the checks that run offline in the local environment (make lint).
#
# ansible-test wants the collection at .../ansible_collections/shardfleet/fleet (the
# physical working directory: the .collections symlink does not count), so this copies
# the tracked and untracked-but-not-ignored files there and runs it on the copy.
# Left out: ansible-doc, validate-modules, yamllint, runtime-metadata, pep8, pylint,
# import, changelog — each runs in a virtualenv ansible-test bootstraps with get-pip from
# ci-files.testing.ansible.com (unreachable here) and fills from PyPI (docs/collection.md).
# tests/collection (ansible-doc), yamllint, ruff and ansible-lint cover most of that ground.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
dest=$tmp/ansible_collections/shardfleet/fleet
mkdir -p "$dest"
git -C "$root" ls-files -z --cached --others --exclude-standard \
  | (cd "$root" && tar --null --ignore-failed-read -T - -cf -) | tar -xf - -C "$dest"
cd "$dest"
tests=(action-plugin-docs compile empty-init ignores line-endings no-assert no-get-exception
       no-illegal-filenames no-smart-quotes replace-urlopen shebang symlinks
       use-argspec-type-path use-compat-six)
ansible-test sanity --local --python 3.11 "${tests[@]/#/--test=}" "$@"
