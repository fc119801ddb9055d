package remote

import "testing"

// TestParseLocation: a remote URL's scheme and parts, read the one way
// Open and the lazy layers' sources both take them.
func TestParseLocation(t *testing.T) {
	for _, c := range []struct {
		url              string
		scheme           Scheme
		path, host, repo string
	}{
		{"dir:///srv/layers", SchemeDir, "/srv/layers", "", ""},
		{"DIR:///srv/layers", SchemeDir, "/srv/layers", "", ""},
		{"dir:relative", SchemeDir, "", "", ""}, // Open refuses it: no absolute path
		{"oci://registry.example.com:5000/team/layers/", SchemeOCI, "", "registry.example.com:5000", "team/layers"},
		{"oci://host", SchemeOCI, "", "host", ""},
		{"ftp://x/y", SchemeUnknown, "", "", ""},
		{"nope", SchemeUnknown, "", "", ""},
	} {
		loc, err := ParseLocation(c.url)
		if err != nil {
			t.Errorf("%s: %v", c.url, err)
			continue
		}
		if loc.Scheme != c.scheme || loc.Path != c.path || loc.Host != c.host || loc.Repo != c.repo {
			t.Errorf("%s: %+v, want scheme %d, path %q, host %q, repo %q", c.url, loc, c.scheme, c.path, c.host, c.repo)
		}
	}
	if _, err := ParseLocation("oci://[::1"); err == nil {
		t.Errorf("a URL that does not parse: no error")
	}
}
