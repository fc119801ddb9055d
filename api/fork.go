package api

import "time"

// ForkRequest forks a sandbox into a group: one pack-diff of it and N
// sandboxes started on that snapshot, held by a lease.
type ForkRequest struct {
	N int `json:"n"`
	// Lease names the lease that holds the group (LeaseRequest made it);
	// TTL, instead, makes a lease of that many seconds for it. Neither:
	// the group is held until it is removed.
	Lease string `json:"lease,omitempty"`
	TTL   int    `json:"ttl,omitempty"`
	// Tag is the snapshot's, NAME:STEP (default: fork-SANDBOX:N, the
	// next N free).
	Tag string `json:"tag,omitempty"`
	// NamePrefix names the members PREFIX-1 ... PREFIX-N (default: the
	// snapshot's tag, as a branch's).
	NamePrefix string `json:"name_prefix,omitempty"`
	// Memory: a memory snapshot (a microVM's guest whole), its members
	// continuing its processes.
	Memory bool `json:"memory,omitempty"`
}

// Group is a fork group: the snapshot a fork took and the sandboxes it
// started on it.
type Group struct {
	ID       string    `json:"id"`
	Owner    string    `json:"owner,omitempty"` // the token that made it ("": the admin's)
	Sandbox  string    `json:"sandbox"`         // the sandbox forked
	Snapshot string    `json:"snapshot"`        // NAME:STEP
	Lease    string    `json:"lease,omitempty"` // the lease holding it ("": none, held until removed)
	Created  time.Time `json:"created"`
	Members  []Member  `json:"members"`
}

// Member is a sandbox of a group, as it is now.
type Member struct {
	Name   string `json:"name"`
	Status string `json:"status"` // "gone" once removed by other means
	// LastExec is the id of the last exec started in it ("": none).
	LastExec string `json:"last_exec,omitempty"`
	Execs    int    `json:"execs"`
}

// KeepRequest keeps one member of a group (the branch that becomes the
// next step's parent) and removes the others: the group is no more, and
// the member, still held by the group's lease, stands on its own.
type KeepRequest struct {
	Member string `json:"member"`
}

// LeaseRequest makes a lease, or renews one, for TTL seconds from now.
type LeaseRequest struct {
	TTL int `json:"ttl"`
	// ID names a new lease (default: generated): a gateway makes one
	// lease of one id on every worker.
	ID string `json:"id,omitempty"`
}

// Lease holds fork groups, the sandboxes kept of them and the
// snapshots they stand on until it expires or is removed: then each
// member and kept sandbox is removed, and each snapshot untagged unless
// something else stands on it. A trainer renews its leases; one that
// dies leaves nothing behind past their TTLs.
type Lease struct {
	ID      string    `json:"id"`
	Owner   string    `json:"owner,omitempty"`
	Created time.Time `json:"created"`
	Expires time.Time `json:"expires"`
	Groups  []string  `json:"groups"` // fork groups it holds
	Kept    []string  `json:"kept"`   // sandboxes kept of its groups
	Holds   []string  `json:"holds"`  // the snapshots of its groups
}

// Released is what ending a lease or a group removed, and what it left
// because something else stands on it.
type Released struct {
	Sandboxes []string `json:"sandboxes"` // removed
	Snapshots []string `json:"snapshots"` // untagged
	Kept      []string `json:"kept,omitempty"`
}
