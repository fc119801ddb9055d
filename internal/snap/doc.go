// Package snap will turn a sandbox's overlay upper into an incremental
// layer (pack-diff), branch sandboxes from a snapshot and keep their
// lineage. Nothing is here yet; see the snapshots issue.
package snap
