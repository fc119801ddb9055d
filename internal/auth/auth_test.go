package auth

import (
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/containerd/errdefs"
)

// TestTokens: a token made is checked as its scope until it expires or
// is removed, by this store and another on the same root (another
// process's); the file holds no token, only hashes; anything else is
// refused alike.
func TestTokens(t *testing.T) {
	root := t.TempDir()
	s := Open(root)
	admin, at, err := s.Create(Admin, 0)
	if err != nil {
		t.Fatal(err)
	}
	short, st, err := s.Create(Sandboxes, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(admin, Prefix) || len(admin) != 45 || at.Scope != Admin || !at.Expires.IsZero() || st.Expires.Sub(st.Created) != time.Hour {
		t.Fatalf("%s %+v %+v", admin, at, st)
	}
	// The ID is public (sandboxes name it as their owner): it is no
	// part of the token.
	for _, c := range []struct{ secret, id string }{{admin, at.ID}, {short, st.ID}} {
		if !regexp.MustCompile(`^[0-9a-f]{12}$`).MatchString(c.id) || strings.Contains(c.secret, c.id) {
			t.Fatalf("token id %q of %s", c.id, c.secret)
		}
	}
	b, _ := os.ReadFile(filepath.Join(root, "tokens.json"))
	if strings.Contains(string(b), admin[5:]) || strings.Contains(string(b), short[5:]) {
		t.Fatal("the store holds a token")
	}
	if fi, _ := os.Stat(filepath.Join(root, "tokens.json")); fi.Mode().Perm() != 0o600 {
		t.Fatalf("mode %v", fi.Mode())
	}
	other := Open(root)
	now := time.Now()
	for _, c := range []struct {
		s      *Store
		secret string
		scope  string
	}{{s, admin, Admin}, {other, admin, Admin}, {other, short, Sandboxes}} {
		if tok, err := c.s.Check(c.secret, now); err != nil || tok.Scope != c.scope {
			t.Fatalf("check %s: %+v %v", c.secret[:13], tok, err)
		}
	}
	off := admin[:44] + "0"
	if off == admin {
		off = admin[:44] + "1"
	}
	for what, bad := range map[string]string{"none": "", "wrong": Prefix + strings.Repeat("0", 40), "cut": admin[:44],
		"other prefix": "e2b_" + admin[5:], "one digit off": off} {
		if _, err := s.Check(bad, now); !errdefs.IsUnauthorized(err) || err.Error() != ErrUnauthorized.Error() {
			t.Errorf("%s: %v", what, err)
		}
	}
	if _, err := s.Check(short, now.Add(2*time.Hour)); !errdefs.IsUnauthorized(err) {
		t.Errorf("an expired token: %v", err)
	}
	if err := other.Remove(st.ID); err != nil {
		t.Fatal(err)
	}
	// The first store reads the file again: the token is gone for it too.
	if _, err := s.Check(short, now); !errdefs.IsUnauthorized(err) {
		t.Errorf("a removed token: %v", err)
	}
	if err := s.Remove(st.ID); !errdefs.IsNotFound(err) {
		t.Errorf("remove twice: %v", err)
	}
	if ts, _ := s.List(); len(ts) != 1 || ts[0].ID != at.ID {
		t.Errorf("list %+v", ts)
	}
	if _, _, err := s.Create("root", 0); !errdefs.IsInvalidArgument(err) {
		t.Errorf("a bad scope: %v", err)
	}
	// An E2B key is a token of its own: the same digits under the other
	// prefix are not it.
	key, kt, err := s.CreateWith(Sandboxes, 0, E2BPrefix)
	if err != nil {
		t.Fatal(err)
	}
	if !regexp.MustCompile(`^e2b_[0-9a-f]{40}$`).MatchString(key) || strings.Contains(key, kt.ID) {
		t.Fatalf("e2b key %s, id %s", key, kt.ID)
	}
	if tok, err := other.Check(key, now); err != nil || tok.ID != kt.ID {
		t.Errorf("check the e2b key: %+v %v", tok, err)
	}
	if _, err := s.Check(Prefix+key[4:], now); !errdefs.IsUnauthorized(err) {
		t.Errorf("the e2b key's digits as a dsec token: %v", err)
	}
	if _, _, err := s.CreateWith(Admin, 0, "x_"); !errdefs.IsInvalidArgument(err) {
		t.Errorf("a bad prefix: %v", err)
	}
}

// TestSpec: allowances and quotas are kept with the token and looked
// up by its ID; unknown allowances, negative quotas and either on an
// admin token are refused.
func TestSpec(t *testing.T) {
	s := Open(t.TempDir())
	_, tok, err := s.New(Spec{Scope: Sandboxes, Allow: []string{AllowUnlimited, AllowPolicy, AllowPolicy}, Quota: Quota{Sandboxes: 3, Memory: 1 << 30}})
	if err != nil {
		t.Fatal(err)
	}
	got, ok := Open(s.path[:len(s.path)-len("/tokens.json")]).Lookup(tok.ID)
	if !ok || !slices.Equal(got.Allow, []string{AllowPolicy, AllowUnlimited}) || got.Quota != (Quota{Sandboxes: 3, Memory: 1 << 30}) {
		t.Fatalf("lookup: %+v %v", got, ok)
	}
	if !got.May(AllowPolicy) || (Token{Scope: Sandboxes}).May(AllowPolicy) || !(Token{Scope: Admin}).May(AllowUnlimited) {
		t.Error("May")
	}
	if _, ok := s.Lookup("nosuch"); ok {
		t.Error("lookup of no token")
	}
	for what, spec := range map[string]Spec{
		"unknown allowance": {Scope: Sandboxes, Allow: []string{"root"}},
		"negative quota":    {Scope: Sandboxes, Quota: Quota{Disk: -1}},
		"admin allowance":   {Scope: Admin, Allow: []string{AllowPolicy}},
		"admin quota":       {Scope: Admin, Quota: Quota{Sandboxes: 1}},
	} {
		if _, _, err := s.New(spec); !errdefs.IsInvalidArgument(err) {
			t.Errorf("%s: %v", what, err)
		}
	}
}

// FuzzCheck: no bearer string a client sends is taken but the token
// itself, and none panics the check.
func FuzzCheck(f *testing.F) {
	s := Open(f.TempDir())
	secret, _, err := s.Create(Admin, 0)
	if err != nil {
		f.Fatal(err)
	}
	for _, seed := range []string{"", secret, secret[:44], Prefix, "Bearer " + secret, strings.ToUpper(secret), secret + "\x00"} {
		f.Add(seed)
	}
	now := time.Now()
	f.Fuzz(func(t *testing.T, bearer string) {
		tok, err := s.Check(bearer, now)
		if (err == nil) != (bearer == secret) || (err == nil && tok.Scope != Admin) {
			t.Fatalf("%q: %+v %v", bearer, tok, err)
		}
	})
}

// TestPinAdmin: a pinned admin token is taken as an admin's, beside
// the file's, and never written there; a malformed one is refused.
func TestPinAdmin(t *testing.T) {
	root := t.TempDir()
	s := Open(root)
	user, _, err := s.Create(Sandboxes, 0)
	if err != nil {
		t.Fatal(err)
	}
	pinned := Prefix + strings.Repeat("ab", 20)
	if _, err := s.Check(pinned, time.Now()); err == nil {
		t.Fatal("a token not pinned yet is taken")
	}
	file := filepath.Join(t.TempDir(), "token")
	os.WriteFile(file, []byte(pinned+"\n"), 0o600)
	if err := s.PinAdminFile(file); err != nil {
		t.Fatal(err)
	}
	if tok, err := s.Check(pinned, time.Now()); err != nil || tok.Scope != Admin || tok.ID != PinnedID {
		t.Errorf("the pinned token: %+v %v", tok, err)
	}
	if tok, err := s.Check(user, time.Now()); err != nil || tok.Scope != Sandboxes {
		t.Errorf("the file's token beside it: %+v %v", tok, err)
	}
	if b, _ := os.ReadFile(filepath.Join(root, "tokens.json")); strings.Contains(string(b), digest(pinned)) {
		t.Error("the pinned token is in the file")
	}
	if tok, err := Open(root).Check(pinned, time.Now()); err == nil {
		t.Errorf("another store of the root takes the pinned token: %+v", tok)
	}
	for _, bad := range []string{"", "dsec_short", E2BPrefix + strings.Repeat("ab", 20), Prefix + strings.Repeat("zz", 20)} {
		if err := s.PinAdmin(bad); err == nil {
			t.Errorf("pinned %q", bad)
		}
	}
	if err := s.PinAdminFile(filepath.Join(t.TempDir(), "none")); err == nil {
		t.Error("a missing file pinned")
	}
}

// TestOpenFile: a store in a file another program updates as the
// kubelet updates a Secret's volume (a new directory, the link to it
// swapped) takes the new tokens at the next check, and the old ones no
// longer.
func TestOpenFile(t *testing.T) {
	dir := t.TempDir()
	a, b := filepath.Join(dir, "..a"), filepath.Join(dir, "..b")
	first, _, err := OpenFile(filepath.Join(a, "tokens.json")).New(Spec{Scope: Sandboxes})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("..a", filepath.Join(dir, "..data")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("..data/tokens.json", filepath.Join(dir, "tokens.json")); err != nil {
		t.Fatal(err)
	}
	s := OpenFile(filepath.Join(dir, "tokens.json"))
	if tok, err := s.Check(first, time.Now()); err != nil || tok.Scope != Sandboxes {
		t.Fatalf("the first token: %+v %v", tok, err)
	}
	second, _, err := OpenFile(filepath.Join(b, "tokens.json")).New(Spec{Scope: Admin})
	if err != nil {
		t.Fatal(err)
	}
	os.Chtimes(filepath.Join(b, "tokens.json"), time.Now().Add(time.Second), time.Now().Add(time.Second))
	if err := os.Symlink("..b", filepath.Join(dir, "..tmp")); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(filepath.Join(dir, "..tmp"), filepath.Join(dir, "..data")); err != nil {
		t.Fatal(err)
	}
	if tok, err := s.Check(second, time.Now()); err != nil || tok.Scope != Admin {
		t.Errorf("the second token, once the link is swapped: %+v %v", tok, err)
	}
	if _, err := s.Check(first, time.Now()); !errdefs.IsUnauthorized(err) {
		t.Errorf("the first token, gone from the file: %v", err)
	}
}
