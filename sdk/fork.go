package sdk

import (
	"bytes"
	"context"
	"encoding/json"
	"net/url"

	"github.com/dsec-project/dsec/api"
)

// Fork packs the sandbox (pack-diff) and starts req.N sandboxes on the
// snapshot in one call: a group, held by the lease req.Lease names, or
// by a new one of req.TTL seconds, or (neither) until it is removed.
// The members are named as a branch's (req.NamePrefix-1 ...) and start
// as the sandbox runs (its spec and effective policy).
func (s *Sandbox) Fork(ctx context.Context, req api.ForkRequest) (*api.Group, error) {
	b, _ := json.Marshal(req)
	var out api.Group
	if err := s.c.do(ctx, "POST", s.path("/fork"), bytes.NewReader(b), &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// Groups lists the caller's fork groups, each member's state and last
// exec id.
func (c *Client) Groups(ctx context.Context) ([]api.Group, error) {
	var out []api.Group
	return out, c.do(ctx, "GET", "/groups", nil, &out)
}

// Group is the fork group id.
func (c *Client) Group(ctx context.Context, id string) (*api.Group, error) {
	var out api.Group
	if err := c.do(ctx, "GET", "/groups/"+url.PathEscape(id), nil, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// RemoveGroup removes the group's members, and its snapshot unless
// something else stands on it.
func (c *Client) RemoveGroup(ctx context.Context, id string) (*api.Released, error) {
	var out api.Released
	if err := c.do(ctx, "DELETE", "/groups/"+url.PathEscape(id), nil, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// KeepMember keeps the group's member (the next step's parent) and
// removes the others; the member stays held by the group's lease.
func (c *Client) KeepMember(ctx context.Context, group, member string) (*api.Released, error) {
	b, _ := json.Marshal(api.KeepRequest{Member: member})
	var out api.Released
	if err := c.do(ctx, "POST", "/groups/"+url.PathEscape(group)+"/keep", bytes.NewReader(b), &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// CreateLease makes a lease of ttl seconds, for forks to name.
func (c *Client) CreateLease(ctx context.Context, ttl int) (*api.Lease, error) {
	b, _ := json.Marshal(api.LeaseRequest{TTL: ttl})
	var out api.Lease
	if err := c.do(ctx, "POST", "/leases", bytes.NewReader(b), &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// Leases lists the caller's leases and what each holds.
func (c *Client) Leases(ctx context.Context) ([]api.Lease, error) {
	var out []api.Lease
	return out, c.do(ctx, "GET", "/leases", nil, &out)
}

// RenewLease makes the lease expire ttl seconds from now.
func (c *Client) RenewLease(ctx context.Context, id string, ttl int) (*api.Lease, error) {
	b, _ := json.Marshal(api.LeaseRequest{TTL: ttl})
	var out api.Lease
	if err := c.do(ctx, "POST", "/leases/"+url.PathEscape(id)+"/renew", bytes.NewReader(b), &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// RemoveLease ends the lease now: what it holds is removed, its
// snapshots untagged unless something else stands on them.
func (c *Client) RemoveLease(ctx context.Context, id string) (*api.Released, error) {
	var out api.Released
	if err := c.do(ctx, "DELETE", "/leases/"+url.PathEscape(id), nil, &out); err != nil {
		return nil, err
	}
	return &out, nil
}
