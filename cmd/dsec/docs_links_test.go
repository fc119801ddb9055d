package main

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestDocLinks: every relative link of the front page and the pages
// under docs/ names a file of the repository, and no page points outside
// it (a path of some machine, or a folder beside the repository).
func TestDocLinks(t *testing.T) {
	repo, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	pages := []string{filepath.Join(repo, "README.md")}
	filepath.WalkDir(filepath.Join(repo, "docs"), func(p string, d os.DirEntry, err error) error {
		if err == nil && !d.IsDir() && strings.HasSuffix(p, ".md") {
			pages = append(pages, p)
		}
		return nil
	})
	link := regexp.MustCompile(`\]\(([^)\s]+)(?:\s+"[^"]*")?\)`)
	for _, page := range pages {
		b, err := os.ReadFile(page)
		if err != nil {
			t.Fatal(err)
		}
		rel, _ := filepath.Rel(repo, page)
		for _, m := range link.FindAllStringSubmatch(string(b), -1) {
			target := m[1]
			if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") || strings.HasPrefix(target, "#") {
				continue
			}
			target, _, _ = strings.Cut(target, "#")
			if filepath.IsAbs(target) {
				t.Errorf("%s: link %s is a path of some machine: link a file of the repository", rel, m[1])
				continue
			}
			p := filepath.Join(filepath.Dir(page), target)
			if r, err := filepath.Rel(repo, p); err != nil || strings.HasPrefix(r, "..") {
				t.Errorf("%s: link %s points outside the repository", rel, m[1])
				continue
			}
			if _, err := os.Stat(p); err != nil {
				t.Errorf("%s: link %s: no such file in the repository", rel, m[1])
			}
		}
	}
}
