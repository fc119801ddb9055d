package egress

import (
	"errors"
	"fmt"
	"strings"

	"golang.org/x/net/idna"
)

// MaxName is the longest name in its ASCII form (RFC 1035, without the
// trailing dot).
const MaxName = 253

// lookup maps a name the way a resolver's user would type it to its
// ASCII form: lowercase, IDNA 2008, no bidi or joiner tricks.
var lookup = idna.New(idna.MapForLookup(), idna.BidiRule(), idna.Transitional(false))

// Normalize returns name in its ASCII form (see the package's terms):
// lowercase, one trailing dot dropped, unicode labels to punycode. A
// name that is not one (empty labels, a label too long, characters no
// host name has, an address) is an error.
func Normalize(name string) (string, error) {
	n := strings.TrimSuffix(name, ".")
	if n == "" {
		return "", errors.New("an empty name")
	}
	ascii := true
	for i := 0; i < len(n); i++ {
		if n[i] >= 0x80 {
			ascii = false
			break
		}
	}
	if ascii {
		n = strings.ToLower(n)
	} else {
		var err error
		if n, err = lookup.ToASCII(n); err != nil {
			return "", fmt.Errorf("%q is not an internationalised name: %v", name, err)
		}
	}
	if len(n) > MaxName {
		return "", fmt.Errorf("%q is %d bytes, more than the %d a name may be", name, len(n), MaxName)
	}
	for l := range strings.SplitSeq(n, ".") {
		if err := checkLabel(l); err != nil {
			return "", fmt.Errorf("%q: %v", name, err)
		}
	}
	if allDigits(n[strings.LastIndexByte(n, '.')+1:]) {
		return "", fmt.Errorf("%q is an address or ends in a number, not a name", name)
	}
	return n, nil
}

func checkLabel(l string) error {
	switch {
	case l == "":
		return errors.New("an empty label")
	case len(l) > 63:
		return fmt.Errorf("label %q is longer than 63 bytes", l)
	case l[0] == '-' || l[len(l)-1] == '-':
		return fmt.Errorf("label %q begins or ends with a hyphen", l)
	}
	for i := 0; i < len(l); i++ {
		c := l[i]
		if !('a' <= c && c <= 'z' || '0' <= c && c <= '9' || c == '-' || c == '_') {
			return fmt.Errorf("label %q holds %q, which no host name does", l, c)
		}
	}
	return nil
}

func allDigits(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return s != ""
}

// Depth is how many labels a pattern's wildcard stands for.
type Depth uint8

const (
	Exact Depth = iota // the name itself
	One                // "*.": exactly one label in front
	Any                // "**.": one or more labels in front
)

// Pattern is a rule's name pattern (see the package's terms).
type Pattern struct {
	Depth Depth
	// Name is the name, or what the wildcard stands in front of; in its
	// ASCII form.
	Name string
}

// ParsePattern reads a rule's name pattern: a name, "*.NAME" or
// "**.NAME", normalised. "*", "**", a wildcard over one label ("*.com")
// and a wildcard anywhere but as the whole first label are refused.
func ParsePattern(s string) (Pattern, error) {
	var p Pattern
	rest := s
	switch {
	case strings.HasPrefix(s, "**."):
		p.Depth, rest = Any, s[3:]
	case strings.HasPrefix(s, "*."):
		p.Depth, rest = One, s[2:]
	case s == "*" || s == "**":
		return p, fmt.Errorf("%q allows every name: give the names (or a CIDR such as 0.0.0.0/0)", s)
	}
	if strings.Contains(rest, "*") {
		return p, fmt.Errorf("%q: a wildcard is a whole first label, \"*.\" (one label) or \"**.\" (any depth), nowhere else", s)
	}
	n, err := Normalize(rest)
	if err != nil {
		return p, err
	}
	if p.Depth != Exact && !strings.Contains(n, ".") {
		return p, fmt.Errorf("%q is a wildcard over the top-level domain %q, which opens too much: name a domain under it", s, n)
	}
	p.Name = n
	return p, nil
}

// String is the pattern as a rule writes it, normalised.
func (p Pattern) String() string {
	return [...]string{"", "*.", "**."}[p.Depth] + p.Name
}

// Match says whether the pattern admits name, which is in its ASCII
// form (Normalize's).
func (p Pattern) Match(name string) bool {
	if p.Depth == Exact {
		return name == p.Name
	}
	front, ok := strings.CutSuffix(name, "."+p.Name)
	if !ok || front == "" {
		return false
	}
	return p.Depth == Any || !strings.Contains(front, ".")
}
