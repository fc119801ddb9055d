// Package auth holds the tokens the worker's TCP API takes: made with
// dsec token create, stored hashed under the root (<root>/tokens.json,
// mode 0600), checked on every request that does not come over the
// root's unix socket (whose file permissions are its guard).
//
// A token is "dsec_" and 40 hex digits; its ID (what dsec token ls
// shows, rm takes and sandboxes name as their owner) is 12 hex digits
// of its own, drawn apart from the token: knowing an ID tells nothing
// of a token (tokens made before IDs were drawn apart have the token's
// first 8 digits as their ID: make them again). Only its SHA-256 is
// stored. A token's scope is admin (everything) or sandboxes: it creates
// sandboxes and acts only on those it created, their snapshots and
// their branches, within its quota and with what Allow lets it do
// beyond that.
package auth

import (
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/internal/durable"
)

// Scopes.
const (
	Admin     = "admin"     // everything
	Sandboxes = "sandboxes" // its own sandboxes, snapshots and branches
)

// Prefix starts every token; E2BPrefix one made for E2B's SDKs (dsec
// token create --e2b), which older ones check keys against.
const (
	Prefix    = "dsec_"
	E2BPrefix = "e2b_"
)

// Token is a stored token: never the token itself.
type Token struct {
	ID      string    `json:"id"`
	Scope   string    `json:"scope"`
	Created time.Time `json:"created"`
	Expires time.Time `json:"expires,omitzero"` // zero: never
	SHA256  string    `json:"sha256"`           // of the whole token
	// Allow lists what a token of scope sandboxes may do beyond the
	// basics (AllowPolicy, AllowUnlimited); an admin token may all.
	Allow []string `json:"allow,omitempty"`
	// Quota bounds what a token of scope sandboxes holds at once.
	Quota Quota `json:"quota,omitzero"`
	// Policies, if any, are the stored policies a token of scope
	// sandboxes may name for its sandboxes (besides the default); it
	// sees no other.
	Policies []string `json:"policies,omitempty"`
}

// What a token of scope sandboxes may be allowed (dsec token create
// --allow).
const (
	// AllowPolicy: give its sandboxes policies of its own (inline in a
	// create, or with policy apply). Without it they run under the
	// default policy, a stored one named at create, or their template's,
	// and keep it.
	AllowPolicy = "policy"
	// AllowUnlimited: ask for no memory, pids or disk limit
	// (api.Unlimited). Without it such a create is refused.
	AllowUnlimited = "unlimited"
)

// Allowances are the valid Allow values.
var Allowances = []string{AllowPolicy, AllowUnlimited}

// Quota bounds what a token's sandboxes and snapshots hold together;
// a zero field bounds nothing.
type Quota struct {
	Sandboxes int   `json:"sandboxes,omitempty"` // sandboxes at once, queued and stopped ones included
	Memory    int64 `json:"memory,omitempty"`    // bytes: the sum of their memory limits
	Disk      int64 `json:"disk,omitempty"`      // bytes: the sum of their disk bounds
	// SnapshotBytes bounds the bytes of its snapshots in the store.
	SnapshotBytes int64 `json:"snapshot_bytes,omitempty"`
}

// May says whether t may do what (AllowPolicy, AllowUnlimited): an admin
// token may all.
func (t Token) May(what string) bool { return t.Scope == Admin || slices.Contains(t.Allow, what) }

// Expired says whether t has expired at now.
func (t Token) Expired(now time.Time) bool { return !t.Expires.IsZero() && !now.Before(t.Expires) }

// ErrUnauthorized is every refused token's error: it says nothing of
// why (no token, a wrong one, an expired one).
var ErrUnauthorized = fmt.Errorf("unauthorized: %w", errdefs.ErrUnauthenticated)

// Store is a root's tokens. Check re-reads the file when it changed
// (a token created or removed by another process).
type Store struct {
	path string

	mu     sync.Mutex
	tokens []Token
	stamp  [2]int64 // the file's mtime and size when read
	pinned []Token  // PinAdmin's, never in the file
}

// PinnedID is the ID of a token PinAdmin holds.
const PinnedID = "pinned"

// PinAdmin has the store take secret as an admin token for as long as
// it is open, without writing it to the file: the token an orchestrator
// hands every worker of a fleet and its gateways (a Kubernetes
// Secret's, admin_token_file), gone with the process that pinned it.
func (s *Store) PinAdmin(secret string) error {
	secret = strings.TrimSpace(secret)
	digits, ok := strings.CutPrefix(secret, Prefix)
	if !ok || len(digits) != 40 || strings.Trim(digits, "0123456789abcdef") != "" {
		return fmt.Errorf("a pinned admin token must be %s and 40 hex digits (as dsec token create prints one): %w", Prefix, errdefs.ErrInvalidArgument)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.pinned = append(s.pinned, Token{ID: PinnedID, Scope: Admin, SHA256: digest(secret)})
	return nil
}

// PinAdminFile is PinAdmin of the token file holds.
func (s *Store) PinAdminFile(file string) error {
	b, err := os.ReadFile(file)
	if err != nil {
		return fmt.Errorf("the admin token file: %w", err)
	}
	if err := s.PinAdmin(string(b)); err != nil {
		return fmt.Errorf("%s: %w", file, err)
	}
	return nil
}

// Open is the token store of root.
func Open(root string) *Store { return OpenFile(filepath.Join(root, "tokens.json")) }

// OpenFile is the token store in file (as Open writes one): replicas of
// a gateway share one, a Kubernetes Secret's (read only: its tokens are
// made elsewhere and the Secret updated; a change is read at the next
// check).
func OpenFile(file string) *Store { return &Store{path: file} }

// CheckScope refuses an unknown scope.
func CheckScope(scope string) error {
	if scope != Admin && scope != Sandboxes {
		return fmt.Errorf("unknown scope %q: use %s (everything) or %s (its own sandboxes): %w", scope, Admin, Sandboxes, errdefs.ErrInvalidArgument)
	}
	return nil
}

// Create makes a token of scope, valid for ttl (0: until removed), and
// returns it: the only time it is seen whole.
func (s *Store) Create(scope string, ttl time.Duration) (string, Token, error) {
	return s.New(Spec{Scope: scope, TTL: ttl})
}

// CreateWith is Create of a token that starts with prefix (Prefix or
// E2BPrefix).
func (s *Store) CreateWith(scope string, ttl time.Duration, prefix string) (string, Token, error) {
	return s.New(Spec{Scope: scope, TTL: ttl, Prefix: prefix})
}

// Spec is a token to make.
type Spec struct {
	Scope  string
	TTL    time.Duration // 0: until removed
	Prefix string        // Prefix (default) or E2BPrefix
	Allow  []string
	Quota  Quota
	// Policies: Token.Policies.
	Policies []string
}

// New makes the token spec describes and returns it: the only time it
// is seen whole.
func (s *Store) New(spec Spec) (string, Token, error) {
	prefix := spec.Prefix
	if prefix == "" {
		prefix = Prefix
	}
	if prefix != Prefix && prefix != E2BPrefix {
		return "", Token{}, fmt.Errorf("bad token prefix %q: %w", prefix, errdefs.ErrInvalidArgument)
	}
	if err := CheckScope(spec.Scope); err != nil {
		return "", Token{}, err
	}
	if spec.TTL < 0 {
		return "", Token{}, fmt.Errorf("bad ttl %s: give a positive duration, or none: %w", spec.TTL, errdefs.ErrInvalidArgument)
	}
	for _, a := range spec.Allow {
		if !slices.Contains(Allowances, a) {
			return "", Token{}, fmt.Errorf("unknown allowance %q: give %s: %w", a, strings.Join(Allowances, " or "), errdefs.ErrInvalidArgument)
		}
	}
	q := spec.Quota
	if q.Sandboxes < 0 || q.Memory < 0 || q.Disk < 0 || q.SnapshotBytes < 0 {
		return "", Token{}, fmt.Errorf("a negative quota (%+v): give a positive bound, or none: %w", q, errdefs.ErrInvalidArgument)
	}
	if spec.Scope == Admin && (len(spec.Allow) > 0 || q != (Quota{}) || len(spec.Policies) > 0) {
		return "", Token{}, fmt.Errorf("an admin token may do everything: allowances, quotas and policies are for tokens of scope %s: %w", Sandboxes, errdefs.ErrInvalidArgument)
	}
	for _, p := range spec.Policies {
		if p == "" || strings.ContainsAny(p, "/\x00") {
			return "", Token{}, fmt.Errorf("bad policy name %q: name a stored policy (dsec policy ls): %w", p, errdefs.ErrInvalidArgument)
		}
	}
	b := make([]byte, 20)
	rand.Read(b)
	secret := prefix + hex.EncodeToString(b)
	id := make([]byte, 6) // drawn apart: the ID says nothing of the token
	rand.Read(id)
	t := Token{ID: hex.EncodeToString(id), Scope: spec.Scope, Created: time.Now().UTC().Truncate(time.Second), SHA256: digest(secret),
		Allow: slices.Compact(slices.Sorted(slices.Values(spec.Allow))), Quota: q, Policies: slices.Compact(slices.Sorted(slices.Values(spec.Policies)))}
	if spec.TTL > 0 {
		t.Expires = t.Created.Add(spec.TTL)
	}
	err := s.update(func(ts []Token) ([]Token, error) {
		if slices.ContainsFunc(ts, func(o Token) bool { return o.ID == t.ID }) {
			return nil, fmt.Errorf("token id %s exists: try again: %w", t.ID, errdefs.ErrAlreadyExists)
		}
		return append(ts, t), nil
	})
	return secret, t, err
}

// List lists the tokens, oldest first.
func (s *Store) List() ([]Token, error) { return s.read() }

// Remove removes the token of id.
func (s *Store) Remove(id string) error {
	return s.update(func(ts []Token) ([]Token, error) {
		i := slices.IndexFunc(ts, func(t Token) bool { return t.ID == id })
		if i < 0 {
			return nil, fmt.Errorf("no token %s (dsec token ls lists them): %w", id, errdefs.ErrNotFound)
		}
		return slices.Delete(ts, i, i+1), nil
	})
}

// Lookup finds the stored token of id, expired or not.
func (s *Store) Lookup(id string) (Token, bool) {
	ts, err := s.cached()
	if err != nil {
		return Token{}, false
	}
	for _, t := range ts {
		if t.ID == id {
			return t, true
		}
	}
	return Token{}, false
}

// Check finds the stored token secret is, valid at now.
func (s *Store) Check(secret string, now time.Time) (Token, error) {
	digits, ok := strings.CutPrefix(secret, Prefix)
	if !ok {
		digits, ok = strings.CutPrefix(secret, E2BPrefix)
	}
	if !ok || len(digits) != 40 {
		return Token{}, ErrUnauthorized
	}
	ts, err := s.cached()
	if err != nil {
		return Token{}, ErrUnauthorized
	}
	want := digest(secret)
	s.mu.Lock()
	ts = append(slices.Clip(ts), s.pinned...)
	s.mu.Unlock()
	for _, t := range ts {
		if subtle.ConstantTimeCompare([]byte(t.SHA256), []byte(want)) == 1 && !t.Expired(now) {
			return t, nil
		}
	}
	return Token{}, ErrUnauthorized
}

func digest(secret string) string {
	h := sha256.Sum256([]byte(secret))
	return hex.EncodeToString(h[:])
}

// cached is the tokens as the file now says, read again only when it
// changed.
func (s *Store) cached() ([]Token, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	fi, err := os.Stat(s.path)
	if errors.Is(err, os.ErrNotExist) {
		s.tokens, s.stamp = nil, [2]int64{}
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	if stamp := [2]int64{fi.ModTime().UnixNano(), fi.Size()}; stamp != s.stamp || s.tokens == nil {
		ts, err := s.read()
		if err != nil {
			return nil, err
		}
		s.tokens, s.stamp = ts, stamp
	}
	return s.tokens, nil
}

func (s *Store) read() ([]Token, error) {
	b, err := os.ReadFile(s.path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var ts []Token
	if err := json.Unmarshal(b, &ts); err != nil {
		return nil, fmt.Errorf("token store %s: %v: %w", s.path, err, errdefs.ErrDataLoss)
	}
	return ts, nil
}

// update changes the tokens under the store's lock (one writer across
// processes), atomically and durably.
func (s *Store) update(fn func([]Token) ([]Token, error)) error {
	if err := os.MkdirAll(filepath.Dir(s.path), 0o700); err != nil {
		return err
	}
	unlock, err := durable.Lock(s.path+".lock", true)
	if err != nil {
		return fmt.Errorf("lock the token store: %w", err)
	}
	defer unlock()
	ts, err := s.read()
	if err != nil {
		return err
	}
	if ts, err = fn(ts); err != nil {
		return err
	}
	b, _ := json.MarshalIndent(ts, "", "  ")
	return durable.WriteFile(s.path, b, 0o600)
}
