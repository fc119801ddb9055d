// Package snap turns a sandbox's overlay upper into an incremental
// snapshot layer (Pack, pack-diff), and keeps the lineage of snapshots:
// which layers each stands on, which sandboxes and snapshots stand on
// it (Tree), removing (Remove) and folding chains (Squash).
package snap
